"""Running a user's training script with ``torch.compile`` replaced by an interceptor.

``dcsched profile`` and ``dcsched train`` both run the user's unmodified
script. :func:`run_script` runs it the way ``python script.py args`` would:
as ``__main__`` through :mod:`runpy`, with ``sys.argv`` set to the script and
its arguments and the script's directory first on ``sys.path``; meanwhile
``torch.compile`` is the given interceptor, which sees every compile call
(``torch.compile(model, ...)`` and the decorator form) and returns what the
script then uses. Everything is restored afterwards, and TorchDynamo's caches
are reset before and after.

An interceptor may stop the script early by raising :class:`StopScript`
(``dcsched profile`` does, once it has its step). A ``sys.exit`` in the
script becomes :attr:`ScriptRun.exit_code`; any other exception propagates,
dcsched's own errors unwrapped from TorchDynamo's wrapping.

>>> import tempfile, pathlib
>>> with tempfile.TemporaryDirectory() as tmp:
...     script = pathlib.Path(tmp, "train.py")
...     _ = script.write_text("import sys, torch\\nprint(torch.compile('model'), sys.argv[1:])\\nsys.exit(3)\\n")
...     run_script(script, ["--steps", "2"], lambda model=None, **kwargs: f"compiled {model}")
compiled model ['--steps', '2']
ScriptRun(finished=True, stopped=False, exit_code=3)
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import runpy
import sys
import threading
import traceback
from pathlib import Path
from typing import Callable, Sequence, NoReturn

import torch
import torch.nn as nn

from dcsched.errors import DcschedError


class ScriptError(DcschedError):
    """The script cannot be run (it does not exist)."""


class StopScript(BaseException):
    """Raised by an interceptor to stop the script (a BaseException: the script's ``except Exception`` misses it)."""


@dataclasses.dataclass(frozen=True)
class ScriptRun:
    """How a script run ended: ran to its end (or ``sys.exit``), or stopped by the interceptor; its exit code."""

    finished: bool
    stopped: bool
    exit_code: int


def module_of(target) -> nn.Module | None:
    """The module a ``torch.compile`` call compiles: the module itself, or the owner of a bound method."""
    if isinstance(target, nn.Module):
        return target
    owner = getattr(target, "__self__", None)  # nn.Module.compile compiles a bound method
    return owner if isinstance(owner, nn.Module) else None


def compile_interceptor(compile_module: Callable, error: Callable[[str], Exception], what: str) -> Callable:
    """A ``torch.compile`` stand-in: ``compile_module(target, module, kwargs)`` for each compiled module.

    Handles the decorator form (``@torch.compile(...)``) and ``nn.Module.compile``'s
    bound method; compiling anything but a module raises ``error`` with a
    message ending in ``what`` (what dcsched does with compiled modules).
    """
    def compile(model=None, **kwargs):
        if model is None:  # decorator form: @torch.compile(...)
            return lambda m: compile(m, **kwargs)
        module = module_of(model)
        if module is None:
            name = getattr(model, "__qualname__", type(model).__name__)
            raise error(f"the script compiles {name}, which is not an nn.Module; {what}: call torch.compile(model) "
                        "on the module")
        return compile_module(model, module, kwargs)

    return compile


def exit_code_of(exc: SystemExit) -> int:
    """The process exit code ``sys.exit(code)`` means: None is 0, a message is 1 (Python prints it)."""
    if exc.code is None:
        return 0
    if isinstance(exc.code, int):
        return exc.code
    print(exc.code, file=sys.stderr)
    return 1


#: A frame of the user's code in a TorchDynamo message (after its "from user code:" line).
_USER_FRAME = re.compile(r'File "([^"]+)", line (\d+)')


def describe_exception(exc: BaseException) -> str:
    """``'ValueError: bad (train.py:12)'``: the type, the first line of the message and where it was raised.

    A TorchDynamo error (a graph break under ``fullgraph=True``, say) says why
    (its ``Explanation:``) and points at the user's line it names, not into torch.

    >>> try:
    ...     raise RuntimeError("Failed to trace builtin operator\\n  Explanation: Dynamo does not know `print`"
    ...                        "\\n\\nfrom user code:\\n   File \\"train.py\\", line 7, in forward\\n    print(x)")
    ... except RuntimeError as exc:
    ...     print(describe_exception(exc))
    RuntimeError: Failed to trace builtin operator: Dynamo does not know `print` (train.py:7)
    """
    text = str(exc).strip()
    message = f"{type(exc).__name__}: {text.splitlines()[0]}" if text else type(exc).__name__
    head, found, user_code = text.partition("from user code:")
    frames = _USER_FRAME.findall(user_code) if found else []
    if frames:
        why = next((line.strip()[len("Explanation:"):].strip() for line in head.splitlines()
                    if line.strip().startswith("Explanation:")), "")
        return f"{message}{': ' + why if why else ''} ({frames[-1][0]}:{frames[-1][1]})"
    frames = traceback.extract_tb(exc.__traceback__)
    return f"{message} ({frames[-1].filename}:{frames[-1].lineno})" if frames else message


def unwrap_dynamo_error(exc: BaseException) -> BaseException:
    """The dcsched error (or :class:`StopScript`) TorchDynamo wrapped ``exc`` around, else ``exc``.

    A backend's errors and an interceptor's stop reach the script's caller
    wrapped in TorchDynamo's exceptions.
    """
    inner = getattr(exc, "inner_exception", None) or exc.__cause__
    while isinstance(inner, BaseException) and not isinstance(inner, (DcschedError, StopScript)):
        nxt = getattr(inner, "inner_exception", None) or inner.__cause__
        if nxt is None:
            break
        inner = nxt
    return inner if isinstance(inner, (DcschedError, StopScript)) else exc


@contextlib.contextmanager
def fresh_dynamo():
    """TorchDynamo's caches reset on entry and on exit (each capture or run compiles afresh)."""
    import torch._dynamo
    torch._dynamo.reset()
    try:
        yield
    finally:
        torch._dynamo.reset()


@contextlib.contextmanager
def script_environment(path: Path, argv: Sequence[str], compile_fn: Callable):
    """``sys.argv``, ``sys.path`` and ``torch.compile`` as the script should see them, restored on exit.

    ``os._exit`` called by the script itself (its main thread, in this process) ends the script as
    ``sys.exit`` would, so dcsched still reports what it ran (profile: that there was no step to capture);
    anywhere else (a forked child, a watch thread) it is the real one.
    """
    saved_argv, saved_path, saved_compile, real_exit = sys.argv[:], sys.path[:], torch.compile, os._exit
    sys.argv = [str(path), *argv]
    sys.path.insert(0, str(path.parent.resolve()))
    torch.compile = compile_fn
    pid = os.getpid()

    def script_exit(status: int) -> NoReturn:
        if os.getpid() == pid and threading.current_thread() is threading.main_thread():
            raise SystemExit(status)
        real_exit(status)

    os._exit = script_exit
    try:
        yield
    finally:
        os._exit = real_exit
        torch.compile = saved_compile
        sys.argv, sys.path = saved_argv, saved_path


def run_script(path: str | os.PathLike, argv: Sequence[str], compile_fn: Callable) -> ScriptRun:
    """Run ``path`` as ``__main__`` with ``argv``, ``torch.compile`` replaced by ``compile_fn``.

    Returns how it ended; the script's exceptions propagate (dcsched errors
    unwrapped), except :class:`StopScript`, which ends the run as stopped.
    """
    path = Path(path)
    if not path.is_file():
        raise ScriptError(f"{path}: no such script")
    with fresh_dynamo(), script_environment(path, argv, compile_fn):
        try:
            runpy.run_path(str(path), run_name="__main__")
        except StopScript:
            return ScriptRun(finished=False, stopped=True, exit_code=0)
        except SystemExit as exc:
            return ScriptRun(finished=True, stopped=False, exit_code=exit_code_of(exc))
        except DcschedError:
            raise
        except Exception as exc:
            inner = unwrap_dynamo_error(exc)
            if isinstance(inner, StopScript):
                return ScriptRun(finished=False, stopped=True, exit_code=0)
            if inner is not exc:
                raise inner from None
            raise
    return ScriptRun(finished=True, stopped=False, exit_code=0)
