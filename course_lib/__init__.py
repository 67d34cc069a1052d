"""course_lib: the small, real training library behind the amp-course notebooks.

Flat modules, one idea each (the chapter that introduces each in brackets):
  device           hardware report and the precision policy                  [00]
  data             shipped dataset, seeded loaders, synthetic batches        [00]
  models           SimpleCNN (seed 000, corrected), MLP, ResNets             [00]
  train            the one training loop for fp32 / bf16 / fp16              [00, 03, 04]
  bench            timing done right, peak memory, MFU, FP32/TF32/AMP table  [00, 06, 09]
  grading, checks  inline check(), exercises from solutions, batch grader    [00]
  colab, nbtools   Colab badge + setup cell; stripped and compared outputs   [00]
  formats          bits of fp32/fp16/bf16/fp8 values, ranges, rounding demos [01]
  widgets          the bit explorer (ipywidgets, with a static fallback)     [01]
  autocast_policy  which ops autocast runs in 16 or 32 bits on this torch    [02]
"""

__version__ = "0.1.0"
