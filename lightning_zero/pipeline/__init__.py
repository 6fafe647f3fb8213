"""Pipeline parallelism (GPipe and 1F1B) on our own point-to-point sends, below the Lightning strategy
``pipeline_scratch`` (``lightning_zero/strategies/pipeline.py``), which builds the stages and hands each step here.

- :mod:`~lightning_zero.pipeline.schedule`: the schedules as pure data, and ``simulate`` to measure their bubble and
  peak activations;
- :mod:`~lightning_zero.pipeline.stages`: which layers each stage holds, and how a batch becomes micro-batches;
- :mod:`~lightning_zero.pipeline.placement`: this stage's layers real, the other stages' meta-device placeholders;
- :mod:`~lightning_zero.pipeline.runtime`: one stage at run time, running its actions and sending activations and
  gradients;
- :mod:`~lightning_zero.pipeline.step`: one Lightning step through the pipeline, with the user's step per micro-batch;
- :mod:`~lightning_zero.pipeline.outputs`: the batch's loss, logged values and outputs combined over its micro-batches;
- :mod:`~lightning_zero.pipeline.gradients`: the gradients across ranks (replica average, global-norm clipping).
"""
