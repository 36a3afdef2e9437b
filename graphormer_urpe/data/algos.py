r"""Graphormer's structural encodings of one graph (``n`` nodes, directed ``edge_index`` with both
directions): ``spd[i, j]`` shortest-path hops (0 on the diagonal, :data:`UNREACHABLE` between
components), ``path_edges[i, j, :]`` the edge ids of ONE shortest path from ``i`` (the BFS tree
path, neighbours scanned in edge-id order, so deterministic), its first ``K = max_hops`` hops,
-1 padded, and ``degree[i]`` out-degree. The work is done in C (``cython_ext/encoding.pyx``),
loaded when a graph is first encoded."""
from __future__ import annotations

import functools
import os
import warnings
from types import ModuleType

import numpy as np

#: The ``spd`` value of a pair in different components.
UNREACHABLE: int = -1
#: Bump whenever the encoder's output for one input changes: encoding caches are keyed by it.
ENCODER_VERSION: str = "1"
#: Largest node or edge count of one graph (the outputs are int16).
MAX_GRAPH_SIZE: int = 32767
#: Largest accepted ``max_hops``.
MAX_HOPS_LIMIT: int = 255

_BUILD = "build it with `pip install -e .` (or `make env` in a source checkout)"


@functools.cache
def _extension() -> ModuleType:
    """The compiled encoder, imported on first use; a one-line ImportError saying how to build it
    when it is missing or stale."""
    try:
        from graphormer_urpe.data import _encoding
    except ImportError as error:
        raise ImportError(f"the compiled graph encoder graphormer_urpe.data._encoding is missing ({error}); "
                          f"{_BUILD}") from None
    for name in ("UNREACHABLE", "MAX_GRAPH_SIZE", "MAX_HOPS_LIMIT"):
        if getattr(_encoding, name, None) != globals()[name]:
            raise ImportError(f"the compiled graph encoder {_encoding.__file__} is stale ({name} differs); "
                              f"re{_BUILD}")
    return _encoding

# libgomp is not fork-safe: a child forked while the parent had live OpenMP threads deadlocks in
# its next multi-threaded region, so a child of a parent with more than one native thread (or an
# unknown count) encodes single-threaded.
_forked_after_threads = False
_threads_at_fork: int | None = None


def _count_threads_before_fork() -> None:
    """Live OS threads of this process (OpenMP pools included); ``None`` where unknown."""
    global _threads_at_fork
    try:
        _threads_at_fork = len(os.listdir("/proc/self/task"))
    except OSError:
        _threads_at_fork = None


def _mark_fork_in_child() -> None:
    global _forked_after_threads
    _forked_after_threads = _forked_after_threads or _threads_at_fork != 1


os.register_at_fork(before=_count_threads_before_fork, after_in_child=_mark_fork_in_child)


def encode_graphs(node_ptr: np.ndarray, edge_index: np.ndarray, edge_ptr: np.ndarray,
                  max_hops: int, num_threads: int = 1) -> dict[str, np.ndarray]:
    """Encodes ``G`` graphs stored back to back (as PyG's ``InMemoryDataset`` stores them):
    ``edge_index`` int64 ``[2, E]`` with LOCAL node ids per graph and both directions present,
    ``max_hops`` in ``[1, 255]``. Returns int16 ``spd [sum n^2]`` and ``path_edges [sum n^2, K]``
    (pair ``(i, j)`` of graph ``g`` at row ``pair_ptr[g] + i n + j``), ``degree [sum n]`` and int64
    ``pair_ptr [G + 1]``. The result is the same for any ``num_threads``; in a process
    forked from a multi-threaded one it falls back to 1 (with a warning), as libgomp would deadlock.
    ValueError for malformed input (naming the problem and the graph), TypeError for a non-array or
    non-integer argument."""
    if (isinstance(num_threads, (int, np.integer)) and not isinstance(num_threads, bool)
            and num_threads > 1 and _forked_after_threads):
        warnings.warn("encode_graphs: this process was forked from a multi-threaded one; using "
                      "num_threads=1 (libgomp would deadlock)", RuntimeWarning, stacklevel=2)
        num_threads = 1
    spd, path_edges, degree, pair_ptr = _extension().encode(node_ptr, edge_index, edge_ptr,
                                                            max_hops, num_threads)
    return {"spd": spd, "path_edges": path_edges.reshape(-1, int(max_hops)), "degree": degree, "pair_ptr": pair_ptr}


def shortest_paths(num_nodes: int, edge_index: np.ndarray,
                   max_hops: int) -> tuple[np.ndarray, np.ndarray]:
    """``spd`` int16 ``[N, N]`` and ``path_edges`` int16 ``[N, N, K]`` of one graph."""
    if isinstance(num_nodes, (bool, np.bool_)) or not isinstance(num_nodes, (int, np.integer)):
        raise TypeError(f"num_nodes must be an int, got {type(num_nodes).__name__}")
    if not 0 <= num_nodes <= MAX_GRAPH_SIZE:
        raise ValueError(f"num_nodes must be in [0, {MAX_GRAPH_SIZE}] (int16 outputs), "
                         f"got {num_nodes}")
    num_edges = edge_index.shape[-1] if isinstance(edge_index, np.ndarray) and edge_index.ndim else 0
    encoded = encode_graphs(np.array([0, num_nodes], dtype=np.int64), edge_index,
                            np.array([0, num_edges], dtype=np.int64), max_hops)
    return (encoded["spd"].reshape(num_nodes, num_nodes),
            encoded["path_edges"].reshape(num_nodes, num_nodes, int(max_hops)))
