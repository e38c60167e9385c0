"""What every ``mp`` worker process imports before it is given work, loaded once per engine process in the fork
server the workers are forked from (:mod:`dovetail.executor.multiproc`): torch, and transformers' configuration
classes, whose first one to load brings in the validators they share (seconds on a small CPU).

Only modules that read no environment variable of Dovetail's or Triton's at import belong here: the fork
server keeps the environment it started with, while each worker takes the engine's as it is when the worker
starts.
"""

import torch  # noqa: F401
from transformers import LlamaConfig  # noqa: F401
