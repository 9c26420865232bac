"""Stage ``data`` says how much of the trained text the draft vocabulary holds (the share of loss-masked tokens whose
id is in it): in the log, as the stage event's ``vocab_coverage``, with a warning below 90 %."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import pytest
import torch

from engine.trainer.config import from_dict
from engine.trainer.threads.metrics import EventLog

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tests/conftest.py


@pytest.mark.parametrize("draft_vocab_size, warns", [(24, True), (200, False)])
def test_the_data_stage_reports_the_share_of_trained_tokens_the_draft_vocabulary_holds(
    tmp_path: Path, small_corpus: Path, draft_vocab_size: int, warns: bool
) -> None:
    from engine.trainer.run.loop import TrainingRun

    cfg = from_dict(
        {
            "target": "tiny",
            "tiny_layers": 4,
            "data": str(small_corpus),
            "buckets": [256],
            "draft_vocab_size": draft_vocab_size,
            "output_dir": str(tmp_path / "out"),
            "torch_threads": 1,
        }
    )
    stdout = io.StringIO()
    events = EventLog(tmp_path / "events.jsonl", stdout=stdout)
    seen: list[dict[str, Any]] = []
    events.listeners.append(seen.append)
    engine = TrainingRun(cfg, events)
    engine.build()

    # The trained tokens, conversation by conversation: each example's ids where its loss mask is set.
    trained = torch.cat(
        [ids[mask.bool()].long() for ids, mask in map(engine.source.example, range(engine.source.examples))]
    )
    in_vocab = torch.isin(trained, engine.vocab.draft_to_target)
    share = int(in_vocab.sum()) / in_vocab.numel()
    (stage,) = [e for e in seen if e["kind"] == "stage" and e.get("vocab_coverage") is not None]
    assert stage["stage"] == "data" and stage["vocab_coverage"] == pytest.approx(share, abs=1e-9)
    assert (share < 0.9) is warns
    lines = stdout.getvalue()
    assert f"it holds {share:.1%} of the trained tokens" in lines
    warning = (
        f"warning: the draft vocabulary ({draft_vocab_size} of the target's {engine.targets[0].vocab_size} ids) holds "
        f"{share:.1%} of the trained tokens, below 90%"
    )
    assert (warning in lines) is warns
