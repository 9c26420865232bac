"""The engine's factories, each called alone: devices, dtypes, schedule, ledgers, drafters, workers, producers."""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import pytest
import torch

from engine.trainer.config import ConfigError, TrainerConfig, from_dict
from engine.trainer.data.dispatch import Dispatcher
from engine.trainer.data.sources import RandomTokenSource
from engine.trainer.data.vocab import DraftVocab, build_draft_vocab
from engine.trainer.draft.loss import soft_cross_entropy_masked_mean
from engine.trainer.draft.model import DraftConfig
from engine.trainer.run import assembly
from engine.trainer.run.producer import Route
from engine.trainer.run.torchrun import RankInfo
from engine.trainer.run.worker import DrafterWorker, WorkerLinks, WorkerSettings
from engine.trainer.threads.control import ThreadControl
from engine.trainer.threads.health import HealthBoard
from engine.trainer.threads.metrics import EventLog
from engine.trainer.threads.queue import BoundedQueue
from engine.trainer.verifier.model import FrozenTarget, load_target, load_tokenizer


def config(**values: Any) -> TrainerConfig:
    return from_dict({"target": "tiny", "tiny_layers": 4, "draft_vocab_size": 32, **values})


def quiet_events() -> EventLog:
    return EventLog(None, stdout=open(os.devnull, "w"))


def control_for(events: EventLog) -> ThreadControl:
    return ThreadControl(events, HealthBoard(events, stall_after_s=60, starve_after_s=60), "stop")


def random_source(target: FrozenTarget) -> RandomTokenSource:
    return RandomTokenSource(target.vocab_size, buckets=[32], batch_size=1, seed=0)


def draft_vocab(cfg: TrainerConfig, target: FrozenTarget) -> DraftVocab:
    return build_draft_vocab(random_source(target), target.vocab_size, cfg.draft_vocab_size)


@pytest.fixture(scope="module")
def target() -> FrozenTarget:
    return load_target(
        "tiny",
        torch.device("cpu"),
        tokenizer=load_tokenizer("tiny"),
        layer_ids=None,
        seed=0,
        dtype=torch.float32,
        tiny_layers=4,
    )


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message a machine without CUDA gives")
def test_a_cuda_device_on_a_machine_without_cuda_is_refused_before_anything_loads() -> None:
    with pytest.raises(ConfigError, match=r"^drafter_devices: names cuda:0, but torch .* sees no CUDA device"):
        assembly.devices_for(config(drafter_devices=["cuda:0"]), RankInfo())


def test_cpu_devices_map_one_to_one_and_auto_attention_is_sdpa_there() -> None:
    cfg = config(target_devices=["cpu"], drafter_devices=["cpu", "cpu"])
    tdevs, ddevs = assembly.devices_for(cfg, RankInfo())
    assert tdevs == [torch.device("cpu")] and ddevs == [torch.device("cpu")] * 2
    assert assembly.attention_impl(cfg, ddevs) == "sdpa"
    with pytest.raises(ConfigError, match=r"^attention: 'flex' needs CUDA drafters"):
        assembly.attention_impl(config(attention="flex"), ddevs)


def test_auto_attention_is_flex_on_cuda_and_merged_is_refused_there_naming_the_measured_bug() -> None:
    cuda = [torch.device("cuda", 0)]  # no GPU is touched: the choice reads the device type only
    assert assembly.attention_impl(config(), cuda) == "flex"
    assert assembly.attention_impl(config(attention="flex"), cuda) == "flex"
    with pytest.raises(ConfigError, match=r"^attention: 'merged' gives wrong gradients on CUDA .* use 'flex'"):
        assembly.attention_impl(config(attention="merged"), cuda)
    with pytest.raises(ConfigError, match=r"^attention: 'merged' gives wrong gradients on CUDA"):
        assembly.attention_impl(
            config(attention="merged", drafter_devices=["cpu", "cuda:0"]), [torch.device("cpu"), *cuda]
        )
    assert assembly.attention_impl(config(attention="merged"), [torch.device("cpu")]) == "merged"  # exact there


def test_flex_bwd_num_stages_reaches_the_flex_call_as_kernel_options_on_cuda_only() -> None:
    dev = torch.device("cpu")
    default, _ = assembly.shared_step(config(), [dev], "flex", lambda _event: None)
    staged, _ = assembly.shared_step(config(flex_bwd_num_stages=2), [dev], "flex", lambda _event: None)
    assert default.flex_options == {} and staged.flex_options == {"bwd_num_stages": 2}
    seen: list[Any] = []

    def spy(*args: Any, **kwargs: Any) -> torch.Tensor:
        seen.append(kwargs.get("kernel_options"))
        return args[0]

    staged._flex = spy  # type: ignore[assignment]  # the call's arguments, not a kernel: the CPU has no Triton
    q = torch.zeros(1, 2, 16, 8)
    staged.apply(q, q, q, mask=object())
    assert seen == [None]  # the CPU's flex gets no Triton options; a CUDA tensor gets {"bwd_num_stages": 2}


def test_dtypes_are_float32_on_the_cpu_and_bfloat16_autocast_on_cuda_unless_float32_is_asked() -> None:
    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    assert assembly.dtypes_for(config(), cpu) == (torch.float32, None)
    assert assembly.dtypes_for(config(), cuda) == (torch.bfloat16, torch.bfloat16)
    assert assembly.dtypes_for(config(dtype="bfloat16"), cpu) == (torch.bfloat16, torch.bfloat16)
    assert assembly.dtypes_for(config(dtype="float32"), cuda) == (torch.float32, None)


def test_the_learning_rate_warms_up_linearly_then_decays_to_zero_at_the_last_step() -> None:
    cosine = assembly.lr_lambda(config(steps=12, warmup_steps=2, schedule="cosine"))
    assert [cosine(s) for s in (0, 1)] == [0.5, 1.0]
    assert cosine(2) == pytest.approx(1.0) and cosine(7) == pytest.approx(0.5) and cosine(12) == pytest.approx(0.0)
    linear = assembly.lr_lambda(config(steps=10, schedule="linear"))
    assert linear(5) == pytest.approx(0.5) and linear(20) == 0.0
    assert assembly.lr_lambda(config(schedule="constant"))(999) == 1.0


def test_replicas_share_one_ledger_and_independent_drafters_keep_one_each() -> None:
    shared = assembly.model_ledgers("replicas", 3)
    assert shared[0] is shared[1] is shared[2]
    own = assembly.model_ledgers("independent", 3)
    assert len({id(ledger) for ledger in own}) == 3


def test_producers_resume_with_the_trained_batches_split_as_they_made_them() -> None:
    split = [assembly.start_batches(7, 3, p) for p in range(3)]
    assert split == [3, 2, 2] and sum(split) == 7


@pytest.mark.parametrize("mode", ["replicas", "independent"])
def test_drafters_start_equal_as_replicas_and_from_their_own_seeds_when_independent(
    target: FrozenTarget, mode: str
) -> None:
    lrs = [1e-3, 2e-3] if mode == "independent" else None
    cfg = config(drafter_mode=mode, drafter_devices=["cpu", "cpu"], drafter_lrs=lrs)
    vocab = draft_vocab(cfg, target)
    dcfg = DraftConfig.from_target(target.config, vocab.size)
    ddevs = [torch.device("cpu")] * 2
    before = torch.random.get_rng_state()
    first, second = assembly.build_drafters(cfg, dcfg, ddevs, [target], vocab)
    assert torch.equal(torch.random.get_rng_state(), before)  # the drafters' seeds leave the run's RNG alone
    same = all(torch.equal(a, b) for a, b in zip(first.parameters(), second.parameters(), strict=True))
    assert same == (mode == "replicas")
    shapes = assembly.gradient_shapes(cfg, [first, second])
    assert len(shapes) == (1 if mode == "replicas" else 2)
    assert shapes[0] == [p.shape for p in first.trainable_parameters()]
    optimizer, scheduler = assembly.build_optimizer(cfg, second, 1)
    assert optimizer.param_groups[0]["lr"] == (2e-3 if mode == "independent" else cfg.lr)
    assert scheduler.get_last_lr() == [optimizer.param_groups[0]["lr"]]


def test_a_worker_takes_its_settings_from_the_config_and_its_model_from_the_training_factory(
    target: FrozenTarget,
) -> None:
    cfg = config(ttt_steps=2, steps=9, buckets=[32, 64], log_every=3, checkpoint_every=4, loss_mean="masked_positions")
    settings = WorkerSettings.from_config(cfg)
    assert (settings.ttt_steps, settings.total_steps, settings.buckets) == (2, 9, (32, 64))
    assert settings.loss_fn is soft_cross_entropy_masked_mean
    same_name = [f.name for f in dataclasses.fields(settings) if f.name not in ("total_steps", "buckets", "loss_fn")]
    assert all(getattr(settings, key) == getattr(cfg, key) for key in same_name)  # a worker key is a config key
    vocab = draft_vocab(cfg, target)
    dev = torch.device("cpu")
    dcfg = DraftConfig.from_target(target.config, vocab.size)
    (drafter,) = assembly.build_drafters(cfg, dcfg, [dev], [target], vocab)
    attention, step_fn = assembly.shared_step(cfg, [dev], "sdpa", lambda _event: None)
    training = assembly.drafter_training(cfg, drafter, 0, dev, attention, step_fn)
    events = quiet_events()
    control = control_for(events)
    ledger = assembly.model_ledgers("replicas", 1)[0]
    worker = DrafterWorker("drafter0", 0, training, settings, WorkerLinks(BoundedQueue(1), control, ledger))
    assert worker.settings is settings and worker.training is training and worker.links.group is None
    assert training.autocast_dtype is None and training.hidden_dtype == torch.float32
    assert worker.last_result is None and worker.step == 0
    routes = [Route(worker.links.queue, dev)]
    dispatcher = Dispatcher([ledger], "replicas")
    (producer,) = assembly.build_producers([target], random_source(target), routes, dispatcher, vocab, control, 5)
    assert producer.name == "target0" and producer.batches == 5 and producer.routes == routes
