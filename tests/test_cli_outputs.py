"""Where commands write: never over a device or an input, every output checked before any write (issue 12)."""

from __future__ import annotations

import errno
import os
import signal
import stat
import subprocess
import sys
import textwrap

import pytest

import dcsched
from bundles import linear_bundle
from dcsched.cli import run
from dcsched.errors import DcschedError
from dcsched.outputs import check_outputs, write_atomic


@pytest.fixture
def bundle_path(tmp_path):
    return dcsched.save(linear_bundle(), tmp_path / "in.pt")


def tree(directory):
    """Every path under ``directory`` with its kind and content, to show nothing changed."""
    found = {}
    for root, dirs, names in os.walk(directory):
        for name in dirs + names:
            path = os.path.join(root, name)
            mode = os.lstat(path).st_mode
            found[os.path.relpath(path, directory)] = (stat.S_IFMT(mode),
                                                       open(path, "rb").read() if stat.S_ISREG(mode) else None)
    return found


def refused(capsys, tmp_path, args, *words):
    before = tree(tmp_path)
    code = run(args)
    err = capsys.readouterr().err.strip()
    assert code == 2, err
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    for word in words:
        assert word in " ".join(err.split()), err
    assert tree(tmp_path) == before, "a refused command changed a file"
    return err


def _fifo(tmp_path):
    path = tmp_path / "fifo"
    os.mkfifo(path)
    return path


def _device(tmp_path):
    path = tmp_path / "null"
    try:
        os.mknod(path, 0o666 | stat.S_IFCHR, os.makedev(1, 3))
    except (PermissionError, OSError) as exc:
        pytest.skip(f"cannot make a device node here ({exc})")
    return path


@pytest.mark.parametrize("make", [_fifo, _device, lambda tmp: tmp / "sub"], ids=["fifo", "device", "directory"])
@pytest.mark.parametrize("flag", ["-o", "--trace", "--plot"])
def test_output_onto_a_non_regular_file_is_refused(bundle_path, tmp_path, capsys, make, flag):
    target = make(tmp_path)
    if target.name == "sub":
        target.mkdir()
    kind_before = stat.S_IFMT(os.lstat(target).st_mode)
    args = ["schedule", str(bundle_path), "--algo", "none", flag, str(target)]
    if flag != "-o":
        args += ["-o", str(tmp_path / "out.pt")]
    refused(capsys, tmp_path, args, str(target), "regular file")
    assert stat.S_IFMT(os.lstat(target).st_mode) == kind_before


def test_write_atomic_refuses_a_fifo(tmp_path):
    fifo = _fifo(tmp_path)
    with pytest.raises(DcschedError, match="FIFO"):
        write_atomic(fifo, lambda f: f.write(b"x"))
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode)


COLLISIONS = {
    "trace over the input": (["-o", "{d}/out/x.pt", "--trace", "{d}/in.pt"], "input"),
    "plot over the input": (["-o", "{d}/x.pt", "--plot", "{d}/in.pt"], "input"),
    "-o and --trace on one path": (["-o", "{d}/z.pt", "--trace", "{d}/z.pt"], "also the output of -o"),
    "--trace and --plot on one path": (["-o", "{d}/z.pt", "--trace", "{d}/p.png", "--plot", "{d}/p.png"],
                                       "also the output of --trace"),
    "one path by two spellings": (["-o", "{d}/z.pt", "--trace", "{d}/sub/../z.pt"], "also the output"),
    "-o of one algorithm onto --trace": (["--algo", "none,list", "-o", "{d}/k.pt", "--trace", "{d}/k.list.pt"],
                                         "also the output of -o (list)"),
}


@pytest.mark.parametrize("case", list(COLLISIONS))
def test_outputs_colliding_with_inputs_or_each_other(bundle_path, tmp_path, capsys, case):
    pytest.importorskip("matplotlib")
    (tmp_path / "sub").mkdir()
    extra, words = COLLISIONS[case]
    extra = [a.format(d=tmp_path) for a in extra]
    algo = [] if "--algo" in extra else ["--algo", "none"]
    refused(capsys, tmp_path, ["schedule", str(bundle_path), *algo, *extra], words)


def test_bad_plot_format_is_refused_before_any_write(bundle_path, tmp_path, capsys):
    pytest.importorskip("matplotlib")
    refused(capsys, tmp_path, ["schedule", str(bundle_path), "--algo", "none", "-o", str(tmp_path / "out/a.pt"),
                               "--plot", str(tmp_path / "out/p.bmpx")], "bmpx", "png")


def test_existing_output_needs_force_in_every_command(bundle_path, tmp_path, capsys):
    out = tmp_path / "in.none.pt"
    assert run(["schedule", str(bundle_path), "--algo", "none"]) == 0
    capsys.readouterr()
    refused(capsys, tmp_path, ["schedule", str(bundle_path), "--algo", "none"], "exists already", "--force")
    trace = tmp_path / "t.json"
    trace.write_text("keep")
    refused(capsys, tmp_path, ["schedule", str(bundle_path), "--algo", "none", "-o", str(tmp_path / "new.pt"),
                               "--trace", str(trace)], "--trace", "exists already")
    assert run(["schedule", str(bundle_path), "--algo", "none", "--force", "--trace", str(trace)]) == 0
    capsys.readouterr()
    assert trace.read_text() != "keep" and dcsched.load(out)
    script = tmp_path / "train.py"
    script.write_text("raise SystemExit('not reached')\n")
    refused(capsys, tmp_path, ["profile", str(script), "-o", str(out)], "exists already", "--force")
    refused(capsys, tmp_path, ["profile", str(script), "-o", str(script)], "would overwrite the input", "--force")


def test_missing_directories_are_created_in_every_command(bundle_path, tmp_path):
    out = tmp_path / "nope" / "a" / "b" / "out.pt"
    assert run(["schedule", str(bundle_path), "--algo", "none", "-o", str(out)]) == 0
    assert dcsched.load(out).provenance["schedule"]["algorithm"] == "none"
    check_outputs({"-o": tmp_path / "also" / "missing" / "graph.pt"}, inputs=[])  # profile's check


def test_output_below_a_file_is_refused(bundle_path, tmp_path, capsys):
    refused(capsys, tmp_path, ["schedule", str(bundle_path), "--algo", "none", "-o", str(bundle_path / "x.pt")],
            "is not a directory")


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only directories")
@pytest.mark.parametrize("command", ["schedule", "profile"])
def test_read_only_directory_one_line(bundle_path, tmp_path, capsys, command):
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o555)
    try:
        args = (["schedule", str(bundle_path), "--algo", "none"] if command == "schedule"
                else ["profile", str(tmp_path / "train.py")])
        refused(capsys, tmp_path, [*args, "-o", str(locked / "out.pt")], "not writable")
    finally:
        locked.chmod(0o755)


def test_a_failing_write_is_one_line_and_leaves_nothing(bundle_path, tmp_path, capsys, monkeypatch):
    def read_only(*args, **kwargs):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS))

    monkeypatch.setattr(os, "replace", read_only)
    monkeypatch.setattr(os, "link", read_only)  # the rename without --force (never replaces a file)
    before = set(os.listdir(tmp_path))
    assert run(["schedule", str(bundle_path), "--algo", "none", "-o", str(tmp_path / "out.pt")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert [line for line in err if "error" in line] == err[-1:], err  # progress lines, then one error line
    assert "Read-only file system" in err[-1] and "out.pt" in err[-1] and "Traceback" not in "".join(err)
    assert set(os.listdir(tmp_path)) == before


def test_temp_files_of_a_killed_writer_are_removed_on_the_next_write(tmp_path):
    target = tmp_path / "k.pt"
    writer = textwrap.dedent(f"""
        import sys, time
        from dcsched.outputs import write_atomic
        def slow(handle):
            handle.write(b"partial"); handle.flush()
            print("writing", flush=True)
            time.sleep(60)
        write_atomic({str(target)!r}, slow)
    """)
    proc = subprocess.Popen([sys.executable, "-c", writer], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "writing"
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        proc.stdout.close()
    stale = [name for name in os.listdir(tmp_path) if name.endswith(".tmp")]
    assert len(stale) == 1 and stale[0].startswith(f".k.pt.{proc.pid}.") and not target.exists()
    write_atomic(target, lambda handle: handle.write(b"whole"))
    assert os.listdir(tmp_path) == ["k.pt"] and target.read_bytes() == b"whole"


def test_a_file_created_at_the_output_while_scheduling_is_never_replaced(bundle_path, tmp_path, capsys,
                                                                         monkeypatch):
    import dcsched.report.compare
    target = tmp_path / "out.pt"
    scheduled = dcsched.report.compare.scheduled_bundle

    def meanwhile(*args, **kwargs):  # another run (or user) writes the output while this one schedules
        target.write_bytes(b"theirs")
        return scheduled(*args, **kwargs)

    monkeypatch.setattr(dcsched.report.compare, "scheduled_bundle", meanwhile)
    assert run(["schedule", str(bundle_path), "--algo", "none", "-o", str(target)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert "was created while dcsched ran (pass --force to replace it)" in err[-1], err
    assert target.read_bytes() == b"theirs"
    assert sorted(os.listdir(tmp_path)) == sorted([bundle_path.name, "out.pt"])  # no temporary file left


def test_force_keeps_the_replaced_files_mode_and_owner(bundle_path, tmp_path):
    target = tmp_path / "out.pt"
    target.write_bytes(b"old")
    os.chmod(target, 0o600)
    owner = 4321 if os.geteuid() == 0 else os.geteuid()  # root can give the file to another user
    os.chown(target, owner, owner if os.geteuid() == 0 else os.getegid())
    assert run(["schedule", str(bundle_path), "--algo", "none", "-o", str(target), "--force"]) == 0
    info = os.stat(target)
    assert stat.S_IMODE(info.st_mode) == 0o600 and info.st_uid == owner
    assert dcsched.load(target).forward is not None


def test_a_long_output_name_fits_its_temporary_name(bundle_path, tmp_path):
    target = tmp_path / ("o" * 245 + ".pt")  # 248 characters: legal, and the temporary name must fit too
    assert run(["schedule", str(bundle_path), "--algo", "none", "-o", str(target)]) == 0
    assert dcsched.load(target).forward is not None


def test_stale_temp_cleanup_leaves_files_dcsched_did_not_make(tmp_path):
    target = tmp_path / "o5.pt"
    users = [tmp_path / ".o5.pt.999999.notes.tmp", tmp_path / ".o5.pt.999999.abc.tmp", tmp_path / ".o5.pt.x.tmp"]
    for path in users:
        path.write_text("mine")
    stale = tmp_path / ".o5.pt.999999.abcd_123.tmp"  # what dcsched makes, of a process that no longer runs
    stale.write_text("partial")
    write_atomic(target, lambda handle: handle.write(b"data"))
    assert all(path.read_text() == "mine" for path in users) and not stale.exists()


def test_a_failing_trace_or_plot_leaves_no_output_at_all(bundle_path, tmp_path, capsys, monkeypatch):
    import dcsched.report.chrome_trace

    def full_disk(path, *args, **kwargs):
        raise DcschedError(f"{path}: cannot be written (No space left on device)")

    monkeypatch.setattr(dcsched.report.chrome_trace, "write_trace", full_disk)
    out, trace = tmp_path / "out.pt", tmp_path / "t.json"
    assert run(["schedule", str(bundle_path), "--algo", "none", "-o", str(out), "--trace", str(trace)]) == 2
    assert "No space left on device" in capsys.readouterr().err
    assert sorted(os.listdir(tmp_path)) == [bundle_path.name]  # neither -o nor a temporary file
