"""A run folder has one writer, refuses what it cannot be, validates before it writes, and is left clean
after a kill: the hardening cases, each one line on stderr, exit 2, nothing on disk changed."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors import safe_open

from hf_fedtask.cli import main
from hf_fedtask.core.files import LOCK_FILE
from hf_fedtask.core.taskvector import TaskVector
from hf_fedtask.engine import run as federation


def _argv(cfg, output_dir, rounds, *extra):
    return ["run", "--tasks", *cfg.tasks, "--base-model", cfg.base_model, "--base-model-id", cfg.base_model_id,
            "--num-clients", "4", "--rounds", str(rounds), "--batch-size", "8", "--local-steps", "3",
            "--max-length", "16", "--min-samples", "4", "--learning-rate", "0.01",
            "--output-dir", str(output_dir), *extra]


def _one_line_error(capsys, *words):
    """The error is one line, the last on stderr (above it at most the model-loading progress bar)."""
    err = capsys.readouterr().err.strip().splitlines()
    errors = [line for line in err if line.startswith("hf-fedtask: error")]
    assert len(errors) == 1 and err[-1] == errors[0] and "Traceback" not in "".join(err), err
    for w in words:
        assert w in errors[0], errors[0]
    return errors[0]


def _snapshot(folder: Path) -> dict:
    """Every file's bytes but the lock file's (it names its last holder)."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*"))
            if p.is_file() and p.name != LOCK_FILE}


def test_a_second_process_on_a_run_folder_is_refused_naming_the_holder(tiny_config, tmp_path):
    """While one process holds a run folder, `hf-fedtask run --resume` on it is refused before it loads
    anything, naming the holder's pid; once the holder is gone the same command runs."""
    from hf_fedtask.core.files import folder_lock

    out = tmp_path / "run"
    assert main(_argv(tiny_config, out, 2, "--no-export")) == 0
    before = _snapshot(out)
    resume = _argv(tiny_config, out, 3, "--no-export", "--resume")
    with folder_lock(out):  # this test process is "the first run"; the second is another process
        second = subprocess.run([sys.executable, "-m", "hf_fedtask.cli", *resume], capture_output=True, text=True)
    assert second.returncode == 2
    err = second.stderr.strip().splitlines()
    assert len(err) == 1 and "in use by pid" in err[0] and f"pid {os.getpid()}" in err[0], second.stderr
    assert _snapshot(out) == before
    assert main(resume) == 0  # the holder gone, the same command runs
    assert [json.loads(line)["round"] for line in (out / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3]


def test_the_lock_of_a_killed_holder_is_released(tmp_path):
    folder = tmp_path / "run"
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time\n"
                               "from hf_fedtask.core.files import folder_lock\n"
                               f"with folder_lock({str(folder)!r}):\n"
                               "    print('locked', flush=True); time.sleep(120)"],
                              stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "locked"
    from hf_fedtask.core.files import folder_lock
    from hf_fedtask.errors import OutputDirError

    with pytest.raises(OutputDirError, match=f"in use by pid {holder.pid}"):
        with folder_lock(folder):
            pass
    holder.kill()  # SIGKILL: no cleanup runs in the holder
    holder.wait()
    with folder_lock(folder):
        pass


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
    assert main(["unlearn", tiny_config.output_dir, "--task", "colors", "--one-shot", "--resume"]) == 2
    _one_line_error(capsys, "--resume", "--one-shot")
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


def test_unlearn_prints_its_folder_and_a_rerun_suggests_what_works(tiny_config, tmp_path, capsys):
    """`hf-fedtask unlearn` ends, as `run` does, with where its result is; a one-shot unlearn run again into
    the same folder has nothing to resume, so its refusal names --overwrite or another --output-dir (and
    --overwrite then works); a federated one, a run, is resumable and says so."""
    from conftest import make_config

    config = make_config(tiny_config.base_model, tiny_config.tasks, tmp_path / "run",
                         strategy_options={"track_task_vectors": True})
    federation.run(config)
    run_dir = Path(config.output_dir)
    capsys.readouterr()
    one_shot = ["unlearn", str(run_dir), "--task", "colors", "--one-shot"]
    assert main(one_shot) == 0
    out = run_dir.with_name("run-negate-colors")
    printed = capsys.readouterr().out.splitlines()
    assert f"results: {out / 'results.json'}" in printed and (out / "results.json").is_file()
    assert f"adapters: {out / 'adapters'}/<task>  (stock PeftModel.from_pretrained)" in printed
    assert json.loads((out / "results.json").read_text())["config"]["output_dir"] == str(out)
    before = _snapshot(out)
    assert main(one_shot) == 2
    line = _one_line_error(capsys, str(out), "nothing to resume", "--overwrite", "--output-dir")
    assert "--resume" not in line
    assert _snapshot(out) == before
    assert main([*one_shot, "--overwrite"]) == 0
    assert f"results: {out / 'results.json'}" in capsys.readouterr().out.splitlines()

    federated = ["unlearn", str(run_dir), "--task", "colors", "--rounds", "1", "--output-dir", str(tmp_path / "fed")]
    assert main(federated) == 0
    printed = capsys.readouterr().out.splitlines()
    assert f"results: {tmp_path / 'fed' / 'results.json'}" in printed
    assert f"plot:    {tmp_path / 'fed' / 'unlearning.png'}" in printed
    assert main(federated) == 2
    _one_line_error(capsys, "--resume", "--overwrite")  # a run: resuming it is what works
    assert main([*federated, "--resume"]) == 0
