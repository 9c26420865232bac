"""The threaded EAGLE-3 drafter trainer: one process per machine, threads drive its GPUs (torch).

Its rooms, from the top floor down (each imports only rooms below it):

* ``__main__`` (``specdec-train``), ``config`` (``TrainerConfig``: the TOML/``--set`` keys and presets),
  ``checkpoint`` (the layout, the run an output directory belongs to, and ``resolve_checkpoint``: which
  checkpoint a path names, for export, eval and serve-check).
* ``run/``: ``run.assembly`` (one small factory per part) -> ``run.loop`` (``TrainingRun``: builds the parts in
  the order every rank follows, runs them, writes checkpoints); ``run.producer`` threads run the frozen target
  and put ``DeviceBatch``es on a bounded queue; ``run.worker`` threads train the drafter; replicas average gradients
  inside the process and, under torchrun (``run.torchrun``, ``run.distributed``), across ranks; ``run.fp8_check``
  measures an FP8 target against its exact weights at the start; ``run.resume`` decides whether this run may use
  its output_dir and what it resumes (the data plan compared).
* ``serve/``: ``serve.evaluate`` (acceptance length τ) and ``serve.export`` (the draft model vLLM and SGLang load).
* ``target/``: ``target.model`` (``FrozenTarget``: a Hugging Face causal LM with hooks on three layers),
  ``target.fp8`` (and ``target.agreement``: how far it moves the training targets), ``target.builtin`` (the
  ``tiny-trained`` target), ``target.tiny_tokenizer``, ``target.model_configs``, ``target.stops`` (where replies
  end: one stop set for regenerate, eval, training-time τ and serve-check), ``target.regenerate``.
* ``draft/``: the drafter (``model``, TTT ``masks``, the TTT ``attention``: merged on CUDA, flex, SDPA), its ``loss``.
* ``data/``: conversations tokenized with the target's chat template (``sources``, cached by ``cache``), the
  held-out split (``holdout``), several conversations a row with their document masks (``packing``), which
  batch index each producer computes next (``dispatch``), the data file read row by row in bounds (``rows``), the draft
  vocabulary with EAGLE-3's d2t/t2d (``vocab``), the shipped ``corpus/``.
* ``threads/``: ``control`` (``ThreadControl``) / ``health`` / ``compile``: stop requests and thread errors,
  heartbeats, the compile guard (torch.compile is not thread-safe); ``queue``; ``metrics`` writes events.jsonl
  (each line one of ``engine.protocol``'s engine-event dataclasses) and the human log lines the supervisor and
  the dashboard read.

Of the rest of ``engine`` only ``protocol`` (the engine events, and the typed-JSON decoder ``config`` checks its
keys with) and ``stackdump`` (SIGUSR1 named stacks) are imported here: the agent and the supervisor never import
torch, and the trainer never imports them.
"""
