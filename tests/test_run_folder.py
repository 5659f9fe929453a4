"""A run folder has one writer, refuses what it cannot be, validates before it writes, and is left clean
after a kill: the hardening cases, each one line on stderr, exit 2, nothing on disk changed."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from safetensors import safe_open

from hf_fedtask.cli import main
from hf_fedtask.core.taskvector import TaskVector
from hf_fedtask.engine import run as federation


def _argv(cfg, output_dir, rounds, *extra):
    return ["run", "--tasks", *cfg.tasks, "--base-model", cfg.base_model, "--base-model-id", cfg.base_model_id,
            "--num-clients", "4", "--rounds", str(rounds), "--batch-size", "8", "--local-steps", "3",
            "--max-length", "16", "--min-samples", "4", "--learning-rate", "0.01", "--output-dir", str(output_dir), *extra]


def _one_line_error(capsys, *words):
    """The error is one line, the last on stderr (above it at most the model-loading progress bar)."""
    err = capsys.readouterr().err.strip().splitlines()
    errors = [line for line in err if line.startswith("hf-fedtask: error")]
    assert len(errors) == 1 and err[-1] == errors[0] and "Traceback" not in "".join(err), err
    for w in words:
        assert w in errors[0], errors[0]
    return errors[0]


def _snapshot(folder: Path) -> dict:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_a_second_process_on_a_run_folder_is_refused_and_the_first_finishes_alone(tiny_config, tmp_path):
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "hf_fedtask.cli", *_argv(tiny_config, out, 25, "--no-export")]
    first = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    metrics = out / "metrics.jsonl"
    deadline = time.time() + 240
    while time.time() < deadline and first.poll() is None and not (metrics.exists() and metrics.read_text()):
        time.sleep(0.05)
    assert first.poll() is None, first.stderr.read()
    second = subprocess.run(cmd + ["--resume"], capture_output=True, text=True)
    assert second.returncode == 2
    err = second.stderr.strip().splitlines()  # refused before the model is even loaded
    assert len(err) == 1 and "in use by pid" in err[0] and str(first.pid) in err[0], second.stderr
    assert first.wait(timeout=240) == 0
    rounds = [json.loads(line)["round"] for line in metrics.read_text().splitlines()]
    assert rounds == list(range(1, 26))


def test_output_dir_that_is_a_file_or_cannot_be_made_is_one_line(tiny_config, tmp_path, capsys):
    afile = tmp_path / "afile"
    afile.write_text("keep me")
    assert main(_argv(tiny_config, afile, 1)) == 2
    _one_line_error(capsys, str(afile), "not a directory")
    assert main(_argv(tiny_config, afile / "sub", 1)) == 2
    _one_line_error(capsys, str(afile / "sub"))
    assert afile.read_text() == "keep me" and sorted(tmp_path.iterdir()) == [afile]


def test_failed_resume_changes_nothing_and_bad_headers_are_one_line(tiny_config, capsys):
    tiny_config.rounds = 1
    federation.run(tiny_config)
    run_dir = Path(tiny_config.output_dir)
    ckpt = run_dir / "checkpoint.safetensors"
    good = TaskVector.load(ckpt)
    capsys.readouterr()
    for label, meta in (("scalars", {k: v for k, v in good.raw_metadata.items() if k != "scalars"}),
                        ("history", {**good.raw_metadata, "history": "[{not json"})):
        good.save(ckpt, metadata=meta)
        before = _snapshot(run_dir)
        assert main(_argv(tiny_config, run_dir, 3, "--resume")) == 2
        _one_line_error(capsys, "checkpoint.safetensors", label)
        assert _snapshot(run_dir) == before  # run_config.yaml (rounds: 1) was not rewritten


def test_export_removes_what_a_killed_export_left_behind(tiny_config, capsys):
    tiny_config.rounds = 1
    federation.run(tiny_config)
    run_dir = Path(tiny_config.output_dir)
    leftovers = [run_dir / "adapters" / ".colors.tmp-x1y2", run_dir / ".compact.old-a9"]
    for p in leftovers:
        p.mkdir()
        (p / "adapter_model.safetensors").write_bytes(b"half")
    assert main(["export", str(run_dir)]) == 0
    assert not any(p.exists() for p in leftovers)
    assert not [p for p in run_dir.rglob(".*") if ".tmp-" in p.name or ".old-" in p.name]


def test_unlearn_with_a_path_for_a_task_is_one_line(tiny_config, capsys):
    tiny_config.rounds = 1
    federation.run(tiny_config)
    parent = Path(tiny_config.output_dir).parent
    before = sorted(p.name for p in parent.iterdir())
    capsys.readouterr()
    assert main(["unlearn", tiny_config.output_dir, "--task", "../../etc", "--rounds", "1"]) == 2
    _one_line_error(capsys, "../../etc")
    assert main(["unlearn", tiny_config.output_dir, "--task", "colors", "--scale", "2", "--rounds", "1"]) == 2
    _one_line_error(capsys, "--scale", "--one-shot")
    assert sorted(p.name for p in parent.iterdir()) == before


def test_resumed_checkpoint_equals_uninterrupted_in_every_tensor_and_header_field_but_timings(tiny_config, tmp_path):
    straight = federation.RunConfig.from_dict({**tiny_config.to_dict(), "output_dir": str(tmp_path / "straight")})
    federation.run(straight)

    def crash(ctx):
        if ctx.round == 1:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        federation.run(tiny_config, callbacks=[crash])
    assert not os.path.exists(Path(tiny_config.output_dir) / "results.json")
    federation.run(tiny_config, resume=True)
    files = [Path(c.output_dir) / "checkpoint.safetensors" for c in (straight, tiny_config)]
    headers, tensors = [], []
    for f in files:
        with safe_open(str(f), "pt") as s:
            headers.append({k: v for k, v in s.metadata().items() if k != "timings"})
            tensors.append({k: s.get_tensor(k) for k in s.keys()})
    assert headers[0] == headers[1]
    assert tensors[0].keys() == tensors[1].keys() and all((tensors[0][k] == tensors[1][k]).all() for k in tensors[0])
