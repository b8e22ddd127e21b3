"""Several processes behind one DVC command: `launch` decides from params and the visible GPUs
whether a stage relaunches itself under `accelerate launch`, and `data_parallel` is what each
rank does in such a run (rank 0 alone writes, the others hand it their results). No torch at
import: the decision is taken before torch initialises CUDA."""
