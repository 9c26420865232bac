"""The threaded EAGLE-3 drafter trainer: one process per machine, threads drive its GPUs (torch).

Its rooms, from the top floor down; each imports only rooms below it (an import-linter ``layers`` contract in
pyproject.toml keeps it so):

1. ``__main__`` (``specdec-train``: train, regenerate, eval, export, serve-check).
2. ``run/``: ``run.assembly`` (one small factory per part) -> ``run.loop`` (``TrainingRun``: builds the parts in
   the order every rank follows, runs them, writes checkpoints); ``run.producer`` threads run the frozen verifier
   and put ``DeviceBatch``es on a bounded queue; ``run.worker`` threads train the drafter; replicas average
   gradients inside the process and, under torchrun (``run.torchrun``, ``run.distributed``), across ranks;
   ``run.fp8_check`` measures an FP8 verifier against its exact weights at the start; ``run.resume`` decides
   whether this run may use its output_dir and what it resumes (the data plan compared).
3. ``serve/``: ``serve.evaluate`` (acceptance length τ), ``serve.export`` (the draft model vLLM and SGLang load),
   ``serve.exported`` (an export read back as a server reads it, any trainer's), ``serve.serve_check`` (vLLM's own
   counts beside ours).
4. ``verifier/`` and ``draft/``, neither importing the other. ``verifier/`` is the frozen target model (the
   verifier of speculative decoding; the config keys keep the word ``target``): ``verifier.model``
   (``FrozenTarget``: a Hugging Face causal LM with hooks on three layers), ``verifier.packed`` (each attention
   kind's mask for packed rows, or why a target cannot be packed), ``verifier.fp8`` (and ``verifier.agreement``:
   how far it moves the training targets), ``verifier.builtin`` (the ``tiny-trained`` target),
   ``verifier.tiny_tokenizer``, ``verifier.model_configs``, ``verifier.stops`` (where replies end: one stop set for
   regenerate, eval, training-time τ and serve-check), ``verifier.regenerate``. ``draft/`` is the drafter
   (``model``, TTT ``masks``, the TTT ``attention``: flex, SDPA, merged) and its ``loss`` (soft cross-entropy, LK).
5. ``data/``, ``threads/`` and ``checkpoint``. ``data/``: conversations tokenized with the target's chat template
   (``sources``, cached by ``cache``), the held-out split (``holdout``), several conversations a row with their
   document masks (``packing``), which batch index each producer computes next (``dispatch``), the data file read
   row by row in bounds (``rows``), the draft vocabulary with EAGLE-3's d2t/t2d (``vocab``), the shipped
   ``corpus/``. ``threads/``: ``control`` (``ThreadControl``) / ``health`` / ``compile``: stop requests and thread
   errors, heartbeats, the compile guard (torch.compile is not thread-safe); ``queue``; ``metrics`` writes
   events.jsonl (each line one of ``engine.protocol``'s engine-event dataclasses) and the human log lines the
   supervisor and the dashboard read. ``checkpoint``: the layout, the run an output directory belongs to, and
   ``resolve_checkpoint`` (which checkpoint a path names, for export, eval and serve-check).
6. ``config`` (``TrainerConfig``: the TOML/``--set`` keys and presets; stdlib only, so a config error is reported
   before torch loads).

Of the rest of ``engine`` only ``protocol`` (the engine events, and the typed-JSON decoder ``config`` checks its
keys with) and ``stackdump`` (SIGUSR1 named stacks) are imported here: the agent and the supervisor never import
torch, and the trainer never imports them.
"""
