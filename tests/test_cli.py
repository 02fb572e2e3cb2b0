"""The `jaxckpt` command, run through the installed console script (jaxckpt/cli.py)."""

import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest
from conftest import sharded

import jaxckpt
from jaxckpt._html import human_bytes as _human_bytes

EXE = os.path.join(os.path.dirname(sys.executable), "jaxckpt")


def cli(*args, ok=(0,)):
    """Run the console script; returns (exit code, stdout, stderr). Output is piped."""
    p = subprocess.run([EXE, *map(str, args)], capture_output=True, text=True, timeout=120,
                       env=dict(os.environ, JAX_PLATFORMS="cpu"))
    assert p.returncode in ok, (p.returncode, p.stdout, p.stderr)
    assert "Traceback" not in p.stderr
    return p.returncode, p.stdout, p.stderr


def state(scale=1.0):
    big = np.arange(512 * 256, dtype=np.float32).reshape(512, 256) * scale  # 512 KiB: packed
    huge = np.linspace(-1, 1, 1 << 20, dtype=np.float32).reshape(1024, 1024) * scale  # 4 MiB: chunk files
    return {"params": {"w": sharded(big, (4,), ("x",), ("x", None)), "huge": sharded(huge, (4,), ("x",), ("x", None)),
                       "b": np.arange(8, dtype=np.int32)},
            "rng": jax.random.key(3), "step": 12}


@pytest.fixture
def run_dir(tmp_path):
    d = tmp_path / "run"
    with jaxckpt.CheckpointManager(d, max_to_keep=3) as mgr:
        for i in range(1, 5):
            mgr.save(i * 10, state(i), metrics={"loss": 1.0 / i})
    return d


def test_the_console_script_is_installed():
    assert os.access(EXE, os.X_OK)
    code, out, _ = cli("--help")
    for command in ("ls", "show", "verify", "diff", "stats", "rm", "gc"):
        assert f"  {command} " in out


def test_ls_lists_committed_steps_and_dead_attempts_apart(run_dir):
    (run_dir / ".50.jaxckpt-tmp-0123456789ab").mkdir()
    (run_dir / ".50.jaxckpt-tmp-0123456789ab" / "junk").write_bytes(b"x" * 100)
    _, out, _ = cli("ls", run_dir, "--json")
    doc = json.loads(out)
    assert [s["step"] for s in doc["steps"]] == [20, 30, 40]
    assert [s["metrics"] for s in doc["steps"]] == [{"loss": 0.5}, {"loss": 1 / 3}, {"loss": 0.25}]
    assert all(s["bytes"] == 512 * 256 * 4 + (1 << 22) + 32 + 8 for s in doc["steps"])
    assert all(s["total_seconds"] > 0 and s["age_s"] >= 0 for s in doc["steps"])
    (attempt,) = doc["attempts"]
    assert (attempt["name"], attempt["step"], attempt["bytes"], attempt["writer_alive"]) == (
        ".50.jaxckpt-tmp-0123456789ab", 50, 100, False)
    _, out, _ = cli("ls", run_dir)
    lines = out.splitlines()
    assert lines[0].split() == ["step", "committed", "age", "size", "blocking", "total", "metrics"]
    assert [ln.split()[0] for ln in lines[1:4]] == ["20", "30", "40"] and "loss=0.25" in lines[3]
    assert "uncommitted attempts" in out and ".50.jaxckpt-tmp-0123456789ab  50    100 B  dead" in out
    # one checkpoint path lists that one
    _, out, _ = cli("ls", run_dir / "40", "--json")
    assert [c["path"] for c in json.loads(out)["checkpoints"]] == [str(run_dir / "40")]


def test_ls_shows_the_stored_size_of_compressed_steps(tmp_path):
    # issue 31: a compressed step listed only its logical size
    d = tmp_path / "run"
    w = np.tile(np.arange(256, dtype=np.float32), (256, 1))
    with jaxckpt.CheckpointManager(d, async_save=False) as mgr:
        mgr.save(1, {"w": w})
    with jaxckpt.CheckpointManager(d, async_save=False, compression="zstd") as mgr:
        mgr.save(2, {"w": w})
    stored = jaxckpt.open(d / "2")["w"].stored_nbytes
    _, out, _ = cli("ls", d, "--json")
    assert [(s["step"], s["bytes"], s["stored_bytes"], s["codecs"]) for s in json.loads(out)["steps"]] == [
        (1, w.nbytes, None, []), (2, w.nbytes, stored, ["zstd"])]
    _, out, _ = cli("ls", d)
    lines = out.splitlines()
    assert lines[0].split() == ["step", "committed", "age", "size", "stored", "blocking", "total", "metrics"]
    assert "  256.0 KiB  -  " in lines[1] and f"  256.0 KiB  {_human_bytes(stored)} zstd  " in lines[2]


def test_ls_advises_a_cadence(run_dir):
    _, out, _ = cli("ls", run_dir, "--json", "--mtbf", 3600)
    advice = json.loads(out)["advice"]
    assert advice["mtbf_s"] == 3600 and advice["interval_s"] > 0
    _, out, _ = cli("ls", run_dir, "--mtbf", 3600)
    assert "cadence (Young-Daly, MTBF 3600s" in out


def test_show_prints_the_tree_with_totals(run_dir):
    _, out, _ = cli("show", run_dir / "40", "--json")
    doc = json.loads(out)
    assert doc["format_version"] == 3 and doc["leaves"] == 5
    assert doc["bytes"] == 512 * 256 * 4 + (1 << 22) + 32 + 8
    params = next(c for c in doc["tree"]["children"] if c["path"] == "params")
    assert params["bytes"] == 512 * 256 * 4 + (1 << 22) + 32 and params["leaves"] == 3
    w = next(c for c in params["children"] if c["path"] == "params/w")
    assert (w["shape"], w["dtype"], w["spec"], w["mesh"], w["bytes"]) == (
        [512, 256], "float32", "P('x', None)", {"x": 4}, 512 * 256 * 4)
    step = next(c for c in doc["tree"]["children"] if c["path"] == "step")
    assert step == {"path": "step", "kind": "value", "value": 12, "bytes": 0, "leaves": 1}
    _, out, _ = cli("show", run_dir / "40", "--depth", 1)
    assert "params/  3 leaves, 4.5 MiB  …" in out and "huge" not in out
    _, out, _ = cli("show", run_dir / "40")
    assert "w  float32[512, 256]  P('x', None) on x=4  512.0 KiB" in out


def test_rm_deletes_steps_and_refuses_unknown_ones(run_dir):
    cli("rm", run_dir, 20, 30)
    assert jaxckpt.CheckpointManager(run_dir, read_only=True).all_steps() == [40]
    code, _, err = cli("rm", run_dir, 7, ok=(1,))
    assert err == f"jaxckpt: no committed step 7 in '{run_dir}'\n"


def test_rm_is_refused_while_a_writer_is_live(run_dir):
    with jaxckpt.CheckpointManager(run_dir):
        code, _, err = cli("rm", run_dir, 40, ok=(1,))
    assert err.startswith(f"jaxckpt: '{run_dir}' is being written by another CheckpointManager: pid {os.getpid()}")
    assert err.count("\n") == 1


def test_gc_says_what_it_would_remove_then_removes_with_yes(run_dir):
    dead = run_dir / ".60.jaxckpt-tmp-0123456789ab"
    dead.mkdir()
    _, out, _ = cli("gc", run_dir)
    assert out == "would remove .60.jaxckpt-tmp-0123456789ab (0 B)\nrun again with --yes to remove them\n"
    assert dead.exists()
    _, out, _ = cli("gc", run_dir, "--yes")
    assert out == "removing .60.jaxckpt-tmp-0123456789ab (0 B)\n" and not dead.exists()
    _, out, _ = cli("gc", run_dir)
    assert out == "nothing to remove\n"


@pytest.mark.parametrize("args,code,message", [
    (["show", "{tmp}/nothing"], 2, "jaxckpt: No checkpoint at '{tmp}/nothing': manifest.json is missing"),
    (["ls", "{tmp}/nothing"], 2, "jaxckpt: '{tmp}/nothing' is not a checkpoint or a manager directory"),
    (["verify", "{tmp}/nothing"], 2, "jaxckpt: No checkpoint at '{tmp}/nothing'"),
    (["frobnicate"], 2, "jaxckpt: No such command 'frobnicate'."),
    (["show"], 2, "jaxckpt: Missing argument 'PATH'."),
    (["rm", "{tmp}", "x"], 2, "jaxckpt: Invalid value for 'STEPS...': 'x' is not a valid integer range."),
])
def test_errors_are_one_line_with_a_nonzero_exit(tmp_path, args, code, message):
    got, out, err = cli(*[a.format(tmp=tmp_path) for a in args], ok=(code,))
    assert err.startswith(message.format(tmp=tmp_path)), err
    assert err.count("\n") == 1


def _flip_a_byte(path):
    with open(path, "r+b") as f:
        f.seek(100)
        b = f.read(1)
        f.seek(100)
        f.write(bytes([b[0] ^ 0xFF]))


@pytest.mark.format1
def test_verify_exit_codes_and_names_the_corrupt_chunk(run_dir):
    code, out, err = cli("verify", run_dir / "30", run_dir / "40")
    assert err == ""  # piped: no progress bar
    assert out.startswith(f"{run_dir / '30'}: ok (5 leaves, ") and f"\n{run_dir / '40'}: ok (5 leaves, " in out
    manifest = json.loads((run_dir / "40" / "manifest.json").read_text())
    key = next(leaf["key"] for leaf in manifest["leaves"] if leaf["path"] == "params/huge")
    _flip_a_byte(run_dir / "40" / "arrays" / key / "c" / "2" / "0")
    code, out, _ = cli("verify", run_dir / "30", run_dir / "40", ok=(1,))
    assert f"{run_dir / '30'}: ok" in out and f"{run_dir / '40'}: CORRUPT" in out
    assert "  leaf 'params/huge' chunk cell [2, 0]: " in out
    _, out, _ = cli("verify", run_dir / "40", "--json", ok=(1,))
    (report,) = json.loads(out)["reports"]
    assert report["ok"] is False and [(p["leaf"], p["chunk"]) for p in report["problems"]] == [
        ("params/huge", "cell [2, 0]")]
    # a path that is not a checkpoint wins over a corrupt one: exit 2
    cli("verify", run_dir / "40", run_dir / "nothing", ok=(2,))


def test_diff_exit_codes_and_differences(tmp_path):
    a, b, c = tmp_path / "a", tmp_path / "b", tmp_path / "c"
    jaxckpt.save(a, state())
    again = state()
    again["params"]["w"] = sharded(np.asarray(again["params"]["w"]), (2,), ("y",), (None, "y"))  # other layout
    jaxckpt.save(b, again)
    _, out, _ = cli("diff", a, b)
    assert out == "identical (5 leaves)\n"
    changed = state()
    w = np.asarray(changed["params"]["w"]).copy()
    w[3, 4] += 0.5
    changed["params"]["w"] = w
    changed["extra"] = np.ones(2)
    del changed["rng"]
    jaxckpt.save(c, changed)
    code, out, _ = cli("diff", a, c, ok=(1,))
    assert out.splitlines() == ["+ extra", "- rng", "≠ params/w: 1 of 131072 elements differ, max |a-b| 0.5, "
                                f"max rel {0.5 / (3 * 256 + 4 + 0.5):.3g}",
                                "3 of 6 leaves differ: 1 value, 1 added, 1 removed; 3 equal"]
    _, out, _ = cli("diff", a, c, "--json", ok=(1,))
    doc = json.loads(out)
    assert doc["identical"] is False and doc["arrays"]["params/w"]["max_abs"] == 0.5


def test_stats_match_numpy(run_dir):
    _, out, _ = cli("stats", run_dir / "40", "params/w", "params/b", "--json")
    doc = json.loads(out)
    w = np.arange(512 * 256, dtype=np.float32).reshape(512, 256) * 4.0
    assert (doc["params/w"]["min"], doc["params/w"]["max"], doc["params/w"]["count"]) == (0.0, float(w.max()), w.size)
    assert doc["params/w"]["mean"] == pytest.approx(float(w.astype(np.float64).mean()), rel=1e-12)
    assert doc["params/w"]["std"] == pytest.approx(float(w.astype(np.float64).std()), rel=1e-12)
    assert (doc["params/b"]["min"], doc["params/b"]["max"], doc["params/b"]["nan"]) == (0, 7, 0)
    _, out, _ = cli("stats", run_dir / "40")
    assert out.splitlines()[0].split() == ["leaf", "min", "max", "mean", "std", "nan", "inf", "dtype"]
    assert len(out.splitlines()) == 1 + 4 + 1 + 2  # the arrays and the key; a blank line; the step's value
    cli("stats", run_dir / "40", "nope", ok=(2,))


def test_stats_shows_inline_values(tmp_path):
    # issue 31: a step counter, a string, a float were rows of dashes
    jaxckpt.save(tmp_path / "c", {"w": np.arange(4, dtype=np.float32), "step": 12, "name": "run-a", "lr": 0.5,
                                  "note": "x" * 100})
    _, out, _ = cli("stats", tmp_path / "c")
    assert out == (
        "leaf  min  max  mean  std      nan  inf  dtype\n"
        "w     0    3    1.5   1.11803  0    0    float32\n"
        "\n"
        "leaf  value" + " " * 57 + "type\n"
        "lr    0.5" + " " * 59 + "float\n"
        "name  'run-a'" + " " * 55 + "str\n"
        "note  '" + "x" * 58 + "…  str\n"
        "step  12" + " " * 60 + "int\n")
    _, out, _ = cli("stats", tmp_path / "c", "step")
    assert out == "leaf  value  type\nstep  12     int\n"
    _, out, _ = cli("stats", tmp_path / "c", "--json")
    doc = json.loads(out)
    assert [doc[k]["value"] for k in ("step", "name", "lr")] == [12, "run-a", 0.5] and "value" not in doc["w"]


def test_progress_bar_only_on_a_terminal(run_dir):
    import pty

    leader, follower = pty.openpty()
    try:
        p = subprocess.run([EXE, "verify", str(run_dir / "40")], stdout=subprocess.PIPE, stderr=follower,
                           text=True, timeout=120, env=dict(os.environ, JAX_PLATFORMS="cpu", COLUMNS="100"))
        os.close(follower)
        follower = None
        chunks = []
        while True:
            try:
                data = os.read(leader, 65536)
            except OSError:  # the terminal closed
                break
            if not data:
                break
            chunks.append(data)
    finally:
        if follower is not None:
            os.close(follower)
        os.close(leader)
    drawn = b"".join(chunks).decode(errors="replace")
    assert p.returncode == 0 and p.stdout.startswith(f"{run_dir / '40'}: ok")
    assert f"verify {run_dir / '40'}" in drawn  # the bar's label, drawn on the terminal only
