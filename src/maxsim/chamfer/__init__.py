"""Chamfer distance between batched point clouds, PyTorch3D's semantics, on the MaxSim machinery
(a tiled pairwise pass with a running min and its argmin, and a backward through the argmin).

- :func:`maxsim.chamfer.chamfer_distance`: the public function (:mod:`maxsim.chamfer.ops`).
- :mod:`maxsim.chamfer.forward`, :mod:`maxsim.chamfer.backward`: kernels and launchers.
- :mod:`maxsim.chamfer.specs`: what each kernel supports; :mod:`maxsim.chamfer.reference`: the
  plain-PyTorch contract (the CPU backend).
"""

from maxsim.chamfer.ops import chamfer_distance

__all__ = ["chamfer_distance"]
