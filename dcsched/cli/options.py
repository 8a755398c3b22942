"""Options shared by the commands: defaults and help from the library's option dataclasses, and ``-O KEY=VALUE``.

A command's option that sets a field of :class:`~dcsched.costmodels.options.ProfileOptions`,
:class:`~dcsched.report.options.ScheduleOptions`, :class:`~dcsched.train.options.TrainOptions` or
:class:`~dcsched.train.options.ScriptOptions` takes its
default and help from that field (:func:`option`), so each default is written once, in the dataclass.
The dataclasses' modules import no torch, so ``dcsched --help`` stays quick.
"""

from __future__ import annotations

import dataclasses
import re

import typer

from dcsched.errors import DcschedError


def _named_field(cls, name: str) -> dataclasses.Field:
    try:
        return next(f for f in dataclasses.fields(cls) if f.name == name)
    except StopIteration:
        raise AttributeError(f"{cls.__name__} has no field {name!r}") from None


def default_of(cls, name: str):
    """The default of dataclass ``cls``'s field ``name``.

    >>> from dcsched.costmodels.options import ProfileOptions
    >>> default_of(ProfileOptions, "iters"), default_of(ProfileOptions, "gpu")
    (5, None)
    """
    field = _named_field(cls, name)
    if field.default is not dataclasses.MISSING:
        return field.default
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    raise AttributeError(f"{cls.__name__}.{name} has no default")


def flag_name(parameter: str) -> str:
    """The flag a parameter has by default: ``cost_model`` -> ``--cost-model``."""
    return "--" + parameter.replace("_", "-")


def help_of(cls, name: str) -> str:
    """The help of dataclass ``cls``'s field ``name`` (its ``metadata["help"]``), for the command line:
    the fields it names as ````field```` become their flags.

    >>> from dcsched.costmodels.options import ProfileOptions
    >>> help_of(ProfileOptions, "gpu")
    'Target GPU: h100, a100 or h200. Needed by --cost-model analytic; also sets the target device memory recorded in the bundle and the interconnect collectives are modelled on.'
    """  # noqa: E501
    text = _named_field(cls, name).metadata.get("help")
    if not text:
        raise AttributeError(f"{cls.__name__}.{name} has no help")
    return re.sub(r"``([a-z][a-z0-9_]*)``", lambda m: flag_name(m.group(1)), text)


def option(cls, name: str, *flags: str, **kwargs):
    """A ``typer.Option`` for dataclass ``cls``'s field ``name``: its default and help, the given ``flags``.

    ``kwargs`` go to ``typer.Option`` (``min=1``, ...); ``default=`` or ``help=`` there replace the field's.
    """
    kwargs.setdefault("help", help_of(cls, name))
    default = kwargs.pop("default", dataclasses.MISSING)
    return typer.Option(default_of(cls, name) if default is dataclasses.MISSING else default, *flags, **kwargs)


# ---------------------------------------------------------------------------
# -O KEY=VALUE: scheduler options
# ---------------------------------------------------------------------------

#: Options with a flag of their own: ``-O key=value`` means the same as the flag (and goes through its parser).
NAMED_OPTIONS = {"memory_budget": "--memory-budget", "budget_scope": "--budget-scope"}


def option_value(text: str):
    """``-O``'s value: an int, a float, ``true`` / ``false`` (any case) as a bool, else the text.

    >>> option_value("3"), option_value("0.5"), option_value("all"), option_value("False")
    (3, 0.5, 'all', False)
    """
    if text.lower() in ("true", "false"):
        return text.lower() == "true"
    for convert in (int, float):
        try:
            return convert(text)
        except ValueError:
            pass
    return text


def named_from_options(memory_budget: str | None, budget_scope: str | None,
                       extra: list[str]) -> tuple[str | None, str | None, list[str]]:
    """``-O memory_budget=...`` / ``-O budget_scope=...`` taken as their flags; the other ``-O`` items.

    >>> named_from_options(None, None, ["memory_budget=1000", "k=3"])
    ('1000', None, ['k=3'])
    """
    named = {"memory_budget": memory_budget, "budget_scope": budget_scope}
    rest = []
    for item in extra:
        key, sep, value = item.partition("=")
        key = key.strip().replace("-", "_")
        if sep and key in NAMED_OPTIONS:
            if named[key] is not None:
                raise DcschedError(f"{NAMED_OPTIONS[key]} given twice (once as -O {key}=...)")
            named[key] = value.strip()
        else:
            rest.append(item)
    return named["memory_budget"], named["budget_scope"], rest


def parse_options(extra: list[str]) -> dict[str, object]:
    """``-O KEY=VALUE`` items as a dict (keys with ``_`` for ``-``, values through :func:`option_value`).

    >>> parse_options(["k=3", "lookahead-ms=1.5"])
    {'k': 3, 'lookahead_ms': 1.5}
    """
    given: dict[str, object] = {}
    for item in extra:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise DcschedError(f"--option {item!r}: expected KEY=VALUE, e.g. --option k=3")
        given[key.strip().replace("-", "_")] = option_value(value.strip())
    return given
