"""The engine: config, sequences, scheduler, model runner, models, sampler, loader."""
