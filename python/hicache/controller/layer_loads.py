"""Layer-by-layer loads of one batch of slot pairs, for the cache controller: the model may start on
layer ``l`` while later layers are still in flight.

Built on the bound pools' public primitives (:class:`~hicache_kernels.binding.KVBinding`):
:meth:`~hicache_kernels.binding.KVBinding.batch_plan` does the per-batch work once and
:meth:`~hicache_kernels.binding.KVBinding.layer_plan` gives each layer's part of it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from hicache_kernels.backends import IOBackend, get_backend
from hicache_kernels.binding import KVBinding

__all__ = ["LayerLoads"]


class LayerLoads:
    """Loads (host to device) of one set of slot pairs, issued layer by layer: ``loads(layer_id)``.

    Making one does the per-batch work once (:meth:`KVBinding.batch_plan`): index checks (one sync for
    CUDA indices when ``check_indices``), and the move of the indices to where the backend reads them
    (to the GPU for ``kernel``/``triton``, on the launch stream; to the host for the copy engines).
    Each layer's copy is prepared by its first call (its route and descriptors: nothing is
    re-validated) and issued; calling a layer again issues it again, copying what the host pool holds
    then. Everything goes to ``stream``, or to the stream current on the pool's device when the loads
    were made.

    Parameters
    ----------
    binding : the bound device and host pools.
    device_indices, host_indices : the slot pairs, as for :meth:`KVBinding.load`.
    backend : an io-backend name or object (default ``"auto"``).
    stream : the stream every layer goes to (None: as above).
    check_indices : check the indices' range and repeats, once.

    Attributes
    ----------
    binding, backend, stream : as given (``backend`` resolved to an object; ``stream`` fixed on a GPU).
    device_indices, host_indices : the indices where the backend reads them.

    Raises
    ------
    TypeError, ValueError, IndexError
        As :meth:`KVBinding.load`, before anything is written.

    Examples
    --------
    >>> import torch
    >>> from hicache_kernels import KVBinding
    >>> k, v = torch.randn(2, 32, 4, 8), torch.randn(2, 32, 4, 8)
    >>> host = torch.randn(2, 16, 2, 4, 8)  # page_first: [2, N_host, L, H, D]
    >>> loads = LayerLoads(KVBinding(k, v, host, layout="page_first", page_size=1), torch.tensor([9, 10]),
    ...                    torch.tensor([0, 1]), backend="direct")
    >>> loads(1)  # layer 1 only
    >>> torch.equal(k[1, 9], host[0, 0, 1]), torch.equal(k[0, 9], host[0, 0, 0])
    (True, False)
    """

    def __init__(
        self,
        binding: KVBinding,
        device_indices: torch.Tensor,
        host_indices: torch.Tensor,
        *,
        backend: str | IOBackend = "auto",
        stream: Any = None,
        check_indices: bool = True,
    ) -> None:
        batch = binding.batch_plan("h2d", device_indices, host_indices, backend=backend, stream=stream,
                                   check_indices=check_indices)  # fmt: skip
        self.backend = get_backend(backend)
        self.binding, self.stream = binding, batch.stream
        self.device_indices, self.host_indices = batch.dst_indices, batch.src_indices  # where the backend reads them
        self._batch = batch
        self._issues: list[Callable[[], None] | None] = [None] * binding.num_layers

    def __len__(self) -> int:
        """The number of layers."""
        return len(self._issues)

    def __call__(self, layer_id: int) -> None:
        """Issue layer ``layer_id``'s load (asynchronous on a GPU).

        Raises ``TypeError`` for a ``layer_id`` that is not an integer, ``ValueError`` for one outside
        ``[0, len(self))``."""
        issue = self._issues[layer_id] if type(layer_id) is int and 0 <= layer_id < len(self._issues) else None
        if issue is None:
            layer = self.binding.layer_plan(self._batch, layer_id)
            issue = self._issues[layer.layer_begin] = self.backend.prepare(layer)
        issue()
