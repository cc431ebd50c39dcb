"""The checks' simulation layer, shared by every lesson: GPUs in name on a machine without one.

- :mod:`.devices`: placed tensors, modules, parameters and losses
  that know where they would be and log every move (the one reader of
  ``.to``/``.cuda``/``.cpu``), and ``GpuFactories``: tensors the learner makes on a GPU
  (``torch.tensor(..., device=...)``, ``zeros_like``, ``.to``) become placed ones;
- :mod:`.cuda`: the simulated ``torch.cuda`` (the one place it is patched);
- :mod:`.parallel`: DataParallel's pieces and DDP over the simulated GPUs, and an NCCL
  backend in name (``simulated_nccl``) while the collectives run on gloo;
- :mod:`.outcome`: what a call of the learner's code did, as data and in words;
- :mod:`.scenarios`: several scenarios of a check in one launch of real ranks.
"""
