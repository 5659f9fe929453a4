"""Progress on stderr for every phase of a run that can last (`hf_fedtask.core.progress`): the server's
per-round evaluation, the generation eval and the export after the last round; stdout stays clean."""

import pytest
from conftest import make_config

from hf_fedtask.engine.run import run

TINY_LLAMA = "hf-fedtask/tiny-llama"


@pytest.fixture
def bars_at_once(monkeypatch):
    """Bars shown at once (they wait PROGRESS_DELAY seconds otherwise, longer than anything here lasts)."""
    monkeypatch.setattr("hf_fedtask.core.progress.PROGRESS_DELAY", 0)
    monkeypatch.setattr("hf_fedtask.client.evaluation.PROGRESS_DELAY", 0)


def test_evaluation_generation_and_export_show_progress_on_stderr(tiny_tasks_dir, tmp_path, bars_at_once, capsys):
    config = make_config(None, tiny_tasks_dir, tmp_path / "run", base_model=TINY_LLAMA, base_model_id=None,
                         max_length=128, num_clients=2, generation_eval=True, max_test_samples=6)
    run(config)
    out, err = capsys.readouterr()
    for phase in ("round 1 evaluate", "generation eval", "export"):
        assert f"{phase}: " in err, phase
        assert phase not in out
    assert "/12 [" in err and "/2 [" in err  # over the two tasks' 6 test examples each; over the two adapters


def test_quick_phases_show_no_bar(tiny_bert_dir, tiny_tasks_dir, tmp_path, capsys):
    run(make_config(tiny_bert_dir, tiny_tasks_dir, tmp_path / "run"))
    err = capsys.readouterr().err
    assert "round 1 evaluate" not in err and "export: " not in err
