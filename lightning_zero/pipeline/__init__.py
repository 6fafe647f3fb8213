"""Pipeline parallelism (in progress): the schedules, as pure data (:mod:`lightning_zero.pipeline.schedule`)."""
