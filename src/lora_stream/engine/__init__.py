"""What runs inside the inference engine's processes: vLLM's API server, engine core and workers.

- :mod:`~lora_stream.engine.plugin`: the vLLM plugin entry point (backend names ``gloo`` and ``lora_stream``);
- :mod:`~lora_stream.engine.receiver`: the workers' half of the weight transfer (:class:`WorkerTransferEngine`);
- :mod:`~lora_stream.engine.reload`: the reload bracket, its check and the rollback snapshot
  (:class:`ReloadBracket`);
- :mod:`~lora_stream.engine.adapter_staging`: adapters staged in memory for vLLM's own ``add_lora``;
- :mod:`~lora_stream.engine.worker_extension`: the worker extension an engine in a child process is driven through;
- :mod:`~lora_stream.engine.probe`: the verification probe through the served model, and its weight digests;
- :mod:`~lora_stream.engine.lease` and :mod:`~lora_stream.engine.guard`: the API server's update lease and its
  guard on the weight routes.

This package never imports a sink (``lora_stream.sinks``) or the trainer's half of the transfer: what both sides
agree on lives in :mod:`lora_stream.transfer.protocol`. It imports vLLM's worker internals, lazily, where it needs
them; nothing outside it does (``tests/test_layout.py`` holds both rules). An engine that runs in the trainer's own
process (the colocated sink) is reached through this package's classes too.

Importing this package imports none of its modules, so that loading the plugin costs nothing.
"""
