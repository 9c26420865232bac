"""The threaded EAGLE-3 drafter trainer: one process per machine, threads drive its GPUs (torch).

How a step flows, room by room:

* ``config`` (the TOML/``--set`` keys and presets) -> ``assembly`` (one small factory per part) ->
  ``engine.Engine`` (builds the parts in the order every rank follows, runs them, writes checkpoints).
* ``data`` / ``datacache`` / ``holdout`` / ``vocab``: conversations tokenized with the target's chat
  template (cached on disk), the held-out split, the draft vocabulary with EAGLE-3's d2t/t2d.
* ``dispatch``: which batch index each producer computes next, every index trained exactly once per epoch.
* ``producer`` threads run the frozen target (``target``, optionally FP8 through ``fp8``) and put
  ``DeviceBatch``es on a bounded ``queue``; ``worker`` threads train the drafter (``draft/``: model,
  TTT masks, compiled flex attention) with ``loss``; replicas average gradients inside the process and,
  under torchrun (``launch``, ``distributed``), across ranks.
* ``control`` / ``health`` / ``compile``: stop requests and thread errors, heartbeats, the compile guard
  (torch.compile is not thread-safe); ``metrics`` writes events.jsonl (kinds from ``engine.protocol``)
  and the human log lines the supervisor and the dashboard read.
* ``checkpoint``, ``evaluate`` (acceptance length τ), ``export`` (the draft model vLLM and SGLang load),
  ``builtin_target`` (the ``tiny-trained`` target) and ``__main__`` (``specdec-train``).

Of the rest of ``engine`` only ``protocol`` (event kinds) and ``stackdump`` (SIGUSR1 named stacks) are
imported here: the agent and the supervisor never import torch, and the trainer never imports them.
"""
