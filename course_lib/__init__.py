"""course_lib: the small, real training library behind the amp-course notebooks.

Flat modules, one idea each (chapter that introduces them in brackets):
  device   hardware report and precision policy            [00]
  data     shipped dataset, loaders, synthetic batches     [00]
  models   SimpleCNN, small ResNet, MLP                    [00]
  train    the one training loop for fp32 / bf16 / fp16    [00, 03, 04]
  autocast_policy  probe which ops autocast runs in 16/32 bits on this torch  [02]
  bench    timing done right, peak memory, MFU, FP32/TF32/AMP table  [00, 06, 09]
  grading  inline check(), exercise generation, batch grader         [00]
  colab    Colab badge and setup cell stamping                       [00]
"""

__version__ = "0.1.0"
