"""Adapters to training frameworks: one call that routes a framework's weight sync through lora_stream.

* :mod:`lora_stream.integrations.trl` -- TRL's ``GRPOTrainer`` and the other trainers that generate with vLLM.
* :mod:`lora_stream.integrations.verl` -- verl's FSDP engine, through its ``model.external_lib`` config line.
"""
