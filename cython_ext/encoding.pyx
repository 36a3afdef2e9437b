# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True, initializedcheck=False
r"""Graph encodings for Graphormer: shortest-path distances, one shortest path per pair, degrees.

For every graph ``g`` (``n`` nodes, ``e`` directed edges, both directions present) and every
source node ``i``, a breadth-first search over a per-graph CSR gives

.. math::
    \mathrm{spd}(i, j) = \min \{ |p| : p \text{ a path } i \to j \}, \qquad
    \mathrm{path}(i, j) = \mathrm{path}(i, \mathrm{parent}_i(j)) \,\|\,
                          [\mathrm{edge}(\mathrm{parent}_i(j) \to j)]

where ``parent_i(j)`` is the node that first discovered ``j``; neighbours are scanned in
increasing edge-id order, so the choice is deterministic. Only the first ``K = max_hops`` hops of
each path are kept, so the cost is ``O(n * e + n^2 * K)`` per graph and memory never depends on
the graph's diameter. Node 0 is an ordinary node here (Graphormer v1's Floyd-Warshall lost the
paths through it).

Flat outputs, with ``pair_ptr[g] = sum_{h<g} n_h^2``:

- ``spd``        int16 ``[sum n^2]``: graph g's ``[n, n]`` block at ``pair_ptr[g]``; -1 = unreachable.
- ``path_edges`` int16 ``[sum n^2 * K]``: graph g's ``[n, n, K]`` block at ``pair_ptr[g] * K``;
  local edge ids (columns relative to ``edge_ptr[g]``), -1 padding.
- ``degree``     int16 ``[sum n]``: number of directed edges leaving each node.

Every input is validated (a C loop that reports an error code and its graph) before any output is
written; the encoding then runs under ``nogil`` without Python objects, in parallel over graphs
when ``num_threads > 1``. Each thread owns scratch sized by the largest graph and graphs are
independent, so the result does not depend on the thread count.

This is the private core (``graphormer_urpe.data._encoding``), loaded on first use by
:mod:`graphormer_urpe.data.algos`, its public API.
"""
import numpy as np

from cython.parallel cimport parallel, prange
from libc.stdint cimport int16_t, int32_t, int64_t, uint64_t
from libc.stdlib cimport free, malloc
from libc.string cimport memcpy, memset

# int16 outputs hold node distances and local edge ids, with -1 kept as padding.
MAX_GRAPH_SIZE = 32767
# Each pair stores K int16 edge ids; more than this is a mistake rather than a use case.
MAX_HOPS_LIMIT = 255
UNREACHABLE = -1

cdef int64_t _MAX_GRAPH_SIZE = MAX_GRAPH_SIZE
cdef int64_t _NO_EDGES[1]

cdef enum:
    _OK = 0
    _NODE_PTR_START
    _EDGE_PTR_START
    _NODE_PTR_DECREASING
    _EDGE_PTR_DECREASING
    _TOO_MANY_NODES
    _TOO_MANY_EDGES
    _NODE_ID_OUT_OF_RANGE
    _ASYMMETRIC
    _NO_MEMORY


cdef struct _Error:
    int code
    int64_t graph
    int64_t column      # global edge column, for errors about one edge
    int64_t value       # the offending value (pointer entry, size or node id)


cdef void _build_csr(int32_t n, int32_t e, const int64_t* key, const int64_t* other,
                     int32_t* ptr, int32_t* adj) noexcept nogil:
    """Groups the ``e`` edges by ``key``; ``adj[2p], adj[2p+1]`` = (``other`` node, local edge id).

    Within a group the edges keep increasing edge-id order (a counting sort is stable).
    ``ptr`` has ``n + 1`` entries; ``adj`` has ``2 e``.
    """
    cdef int32_t k, u, pos
    memset(ptr, 0, (n + 1) * sizeof(int32_t))
    for k in range(e):
        ptr[key[k] + 1] += 1
    for u in range(n):
        ptr[u + 1] += ptr[u]
    # Fill with ptr[u] as the running cursor of group u, then shift back by one group.
    for k in range(e):
        u = <int32_t> key[k]
        pos = ptr[u]
        adj[2 * pos] = <int32_t> other[k]
        adj[2 * pos + 1] = k
        ptr[u] = pos + 1
    for u in range(n, 0, -1):
        ptr[u] = ptr[u - 1]
    ptr[0] = 0


cdef int _validate(const int64_t* node_ptr, const int64_t* edge_ptr, int64_t num_graphs,
                   const int64_t* src, const int64_t* dst, _Error* err) noexcept nogil:
    """Checks pointers, sizes, node-id ranges and symmetry of every graph; the first error wins.

    The caller has checked ``len(node_ptr) == len(edge_ptr) == num_graphs + 1`` and
    ``edge_ptr[-1] == E``; once ``edge_ptr`` starts at 0 and never decreases, every column it
    names is inside ``edge_index``.
    Symmetry (``u -> v`` needs ``v -> u``): for each node ``v`` stamp its out-neighbours, then
    every ``u`` with ``u -> v`` must carry the stamp. ``O(n + e)`` per graph with two CSRs.
    """
    cdef int64_t g, k, n, e, e0, u, v, pos, max_n = 0, max_e = 0
    err.code = _OK
    err.graph = 0
    err.column = -1
    err.value = 0
    if node_ptr[0] != 0:
        err.code = _NODE_PTR_START; err.value = node_ptr[0]
        return err.code
    if edge_ptr[0] != 0:
        err.code = _EDGE_PTR_START; err.value = edge_ptr[0]
        return err.code
    # Sizes before any use of the pointers as offsets.
    for g in range(num_graphs):
        err.graph = g
        if node_ptr[g + 1] < node_ptr[g]:
            err.code = _NODE_PTR_DECREASING; err.value = node_ptr[g + 1]
            return err.code
        if edge_ptr[g + 1] < edge_ptr[g]:
            err.code = _EDGE_PTR_DECREASING; err.value = edge_ptr[g + 1]
            return err.code
        # Both entries are >= 0 here, so the differences cannot overflow.
        n = node_ptr[g + 1] - node_ptr[g]
        e = edge_ptr[g + 1] - edge_ptr[g]
        if n > _MAX_GRAPH_SIZE:
            err.code = _TOO_MANY_NODES; err.value = n
            return err.code
        if e > _MAX_GRAPH_SIZE:
            err.code = _TOO_MANY_EDGES; err.value = e
            return err.code
        max_n = max(max_n, n)
        max_e = max(max_e, e)
    for g in range(num_graphs):
        err.graph = g
        n = node_ptr[g + 1] - node_ptr[g]
        for k in range(edge_ptr[g], edge_ptr[g + 1]):
            err.column = k
            if src[k] < 0 or src[k] >= n:
                err.code = _NODE_ID_OUT_OF_RANGE; err.value = src[k]
                return err.code
            if dst[k] < 0 or dst[k] >= n:
                err.code = _NODE_ID_OUT_OF_RANGE; err.value = dst[k]
                return err.code
    err.column = -1

    cdef int32_t* out_ptr = <int32_t*> malloc((max_n + 1) * sizeof(int32_t))
    cdef int32_t* in_ptr = <int32_t*> malloc((max_n + 1) * sizeof(int32_t))
    cdef int32_t* out_adj = <int32_t*> malloc((2 * max_e + 1) * sizeof(int32_t))
    cdef int32_t* in_adj = <int32_t*> malloc((2 * max_e + 1) * sizeof(int32_t))
    cdef int64_t* stamp = <int64_t*> malloc((max_n + 1) * sizeof(int64_t))
    if out_ptr == NULL or in_ptr == NULL or out_adj == NULL or in_adj == NULL or stamp == NULL:
        free(out_ptr); free(in_ptr); free(out_adj); free(in_adj); free(stamp)
        err.code = _NO_MEMORY; err.graph = -1
        return err.code
    cdef int64_t token = 0   # unique per (graph, node), so stamps never need clearing
    for u in range(max_n):
        stamp[u] = -1
    for g in range(num_graphs):
        n = node_ptr[g + 1] - node_ptr[g]
        e0 = edge_ptr[g]
        e = edge_ptr[g + 1] - e0
        if e == 0:
            continue
        _build_csr(<int32_t> n, <int32_t> e, src + e0, dst + e0, out_ptr, out_adj)
        _build_csr(<int32_t> n, <int32_t> e, dst + e0, src + e0, in_ptr, in_adj)
        for v in range(n):
            token += 1
            for pos in range(out_ptr[v], out_ptr[v + 1]):
                stamp[out_adj[2 * pos]] = token
            for pos in range(in_ptr[v], in_ptr[v + 1]):
                u = in_adj[2 * pos]
                if stamp[u] != token:       # u -> v exists, v -> u does not
                    err.code = _ASYMMETRIC; err.graph = g
                    err.column = e0 + in_adj[2 * pos + 1]
                    break
            if err.code != _OK:
                break
        if err.code != _OK:
            break
    free(out_ptr); free(in_ptr); free(out_adj); free(in_adj); free(stamp)
    return err.code


cdef void _encode_graph(int32_t n, int32_t e, const int64_t* src, const int64_t* dst, int32_t K,
                        int32_t* ptr, int32_t* adj, int32_t* queue, int32_t* via,
                        int16_t* spd, int16_t* path, int16_t* degree) noexcept nogil:
    """All-pairs BFS of one graph into its output blocks (``spd [n, n]``, ``path [n, n, K]``).

    Per source ``s``: a BFS that only records the visiting order (``queue``) and the local id of
    the edge that discovered each node (``via``), then the path rows by DP in that order, where
    the parent's row is final: ``path(s, v) = path(s, u)`` (its -1 padding included) plus the
    edge ``u -> v`` at hop ``spd(s, v) - 1`` if that hop is ``< K``. Copying in a second pass
    (rather than at discovery) keeps the BFS loop short and reads rows whose stores have
    retired; the copy moves 8-byte words (fixed-size ``memcpy`` compiles to one load and one
    store) instead of a generic ``K``-loop.
    """
    cdef int32_t s, u, v, t, pos, head, tail, du, k, hop
    cdef int32_t K4 = K - K % 4            # int16 entries copied as whole 8-byte words
    cdef uint64_t word
    cdef int16_t* row
    cdef int16_t* prow
    cdef int16_t* pu
    cdef int16_t* pv
    _build_csr(n, e, src, dst, ptr, adj)
    for u in range(n):
        degree[u] = <int16_t> (ptr[u + 1] - ptr[u])
    for s in range(n):
        row = spd + <int64_t> s * n
        prow = path + <int64_t> s * n * K
        memset(row, 0xFF, n * sizeof(int16_t))        # all UNREACHABLE (-1)
        row[s] = 0
        queue[0] = s
        head = 0
        tail = 1
        while head < tail:
            u = queue[head]
            head += 1
            du = row[u] + 1
            for pos in range(ptr[u], ptr[u + 1]):
                v = adj[2 * pos]
                if row[v] < 0:
                    row[v] = <int16_t> du
                    queue[tail] = v
                    via[tail] = adj[2 * pos + 1]
                    tail += 1
        pv = prow + <int64_t> s * K
        for t in range(K):
            pv[t] = -1
        for head in range(1, tail):
            v = queue[head]
            k = via[head]
            pu = prow + src[k] * K                     # src[k] = u, the discovering node
            pv = prow + <int64_t> v * K
            for t in range(0, K4, 4):
                memcpy(&word, pu + t, 8)
                memcpy(pv + t, &word, 8)
            for t in range(K4, K):
                pv[t] = pu[t]
            hop = row[v] - 1
            if hop < K:
                pv[hop] = <int16_t> k
        if tail < n:                                   # unreachable pairs: all -1
            for v in range(n):
                if row[v] < 0:
                    memset(prow + <int64_t> v * K, 0xFF, K * sizeof(int16_t))


def _check_index_array(name, array, int ndim):
    if not isinstance(array, np.ndarray):
        raise TypeError(f"{name} must be a numpy.ndarray, got {type(array).__name__}")
    if array.dtype != np.int64:
        raise ValueError(f"{name} must have dtype int64, got {array.dtype}")
    if array.ndim != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {array.shape}")
    if not array.flags.c_contiguous:
        raise ValueError(f"{name} must be C-contiguous (use numpy.ascontiguousarray)")


def _check_positive_int(name, value, int64_t upper):
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < 1 or value > upper:
        raise ValueError(f"{name} must be in [1, {upper}], got {value}")
    return int(value)


cdef object _raise(_Error err):
    g = err.graph
    code = err.code
    if code == _NODE_PTR_START:
        raise ValueError(f"node_ptr must start at 0, got node_ptr[0] = {err.value}")
    if code == _EDGE_PTR_START:
        raise ValueError(f"edge_ptr must start at 0, got edge_ptr[0] = {err.value}")
    if code == _NODE_PTR_DECREASING:
        raise ValueError(f"node_ptr must be non-decreasing: graph {g} has "
                         f"node_ptr[{g + 1}] = {err.value} < node_ptr[{g}]")
    if code == _EDGE_PTR_DECREASING:
        raise ValueError(f"edge_ptr must be non-decreasing: graph {g} has "
                         f"edge_ptr[{g + 1}] = {err.value} < edge_ptr[{g}]")
    if code == _TOO_MANY_NODES:
        raise ValueError(f"graph {g} has {err.value} nodes; at most {MAX_GRAPH_SIZE} fit the "
                         f"int16 outputs")
    if code == _TOO_MANY_EDGES:
        raise ValueError(f"graph {g} has {err.value} edges; at most {MAX_GRAPH_SIZE} fit the "
                         f"int16 outputs")
    if code == _NODE_ID_OUT_OF_RANGE:
        raise ValueError(f"graph {g}: edge_index column {err.column} holds node id {err.value}, "
                         f"outside [0, n_g) (edge_index must hold LOCAL node ids)")
    if code == _ASYMMETRIC:
        raise ValueError(f"graph {g}: edge_index column {err.column} has no reverse edge "
                         f"(edge lists must hold both directions)")
    if code == _NO_MEMORY:
        raise MemoryError("out of memory for the validation scratch buffers")
    raise AssertionError(f"unknown validation error code {code}")  # pragma: no cover


def encode(node_ptr, edge_index, edge_ptr, max_hops, num_threads=1):
    """Encodes a batch of graphs; see the module docstring for the layout.

    Args:
        node_ptr: int64 ``[G + 1]``; graph g has ``node_ptr[g+1] - node_ptr[g]`` nodes.
        edge_index: int64 ``[2, E]`` C-contiguous, LOCAL node ids, both directions present.
        edge_ptr: int64 ``[G + 1]``; columns ``edge_ptr[g]:edge_ptr[g+1]`` belong to graph g.
        max_hops: ``K``, hops kept per path, in ``[1, 255]``.
        num_threads: OpenMP threads over graphs (``>= 1``); results are identical for any value.

    Returns:
        ``(spd, path_edges, degree, pair_ptr)``: int16 ``[sum n^2]``, int16 ``[sum n^2 * K]``,
        int16 ``[sum n]``, int64 ``[G + 1]``.

    Raises:
        TypeError: an argument of the wrong type.
        ValueError: anything malformed, naming the problem and the graph.
    """
    _check_index_array("node_ptr", node_ptr, 1)
    _check_index_array("edge_ptr", edge_ptr, 1)
    _check_index_array("edge_index", edge_index, 2)
    cdef int32_t K = _check_positive_int("max_hops", max_hops, MAX_HOPS_LIMIT)
    cdef int threads = _check_positive_int("num_threads", num_threads, 1024)
    if edge_index.shape[0] != 2:
        raise ValueError(f"edge_index must have shape [2, E], got {edge_index.shape}")
    if node_ptr.shape[0] < 1:
        raise ValueError("node_ptr must have at least one entry (G + 1 for G graphs)")
    if edge_ptr.shape[0] != node_ptr.shape[0]:
        raise ValueError(f"node_ptr and edge_ptr must have the same length G + 1, got "
                         f"{node_ptr.shape[0]} and {edge_ptr.shape[0]}")
    # No negative indices in this module: wraparound=False passes them through to the object.
    cdef int64_t last_edge = edge_ptr[edge_ptr.shape[0] - 1]
    if last_edge != edge_index.shape[1]:
        raise ValueError(f"edge_ptr[-1] = {last_edge} must equal the number of edge_index "
                         f"columns, {edge_index.shape[1]}")

    cdef const int64_t[::1] node_ptr_v = node_ptr
    cdef const int64_t[::1] edge_ptr_v = edge_ptr
    cdef const int64_t[:, ::1] edge_index_v = edge_index
    cdef int64_t num_graphs = node_ptr.shape[0] - 1
    cdef int64_t num_edges = edge_index.shape[1]
    # With no edges the pointers are never dereferenced; point them at a dummy, not NULL.
    cdef const int64_t* src = _NO_EDGES
    cdef const int64_t* dst = _NO_EDGES
    if num_edges > 0:
        src = &edge_index_v[0, 0]
        dst = &edge_index_v[1, 0]
    cdef _Error err
    cdef int code
    with nogil:
        code = _validate(&node_ptr_v[0], &edge_ptr_v[0], num_graphs, src, dst, &err)
    if code != _OK:
        _raise(err)

    # Sizes are validated: compute the offsets, then preallocate every output once.
    counts = np.diff(node_ptr)
    pair_ptr = np.zeros(num_graphs + 1, dtype=np.int64)
    np.cumsum(counts * counts, out=pair_ptr[1:])
    cdef int64_t max_n = int(counts.max()) if num_graphs > 0 else 0
    cdef int64_t max_e = int(np.diff(edge_ptr).max()) if num_graphs > 0 else 0
    cdef int64_t num_pairs = pair_ptr[num_graphs]
    spd = np.empty(num_pairs, dtype=np.int16)
    path_edges = np.empty(num_pairs * K, dtype=np.int16)
    degree = np.empty(node_ptr[num_graphs], dtype=np.int16)
    if num_pairs == 0:
        return spd, path_edges, degree, pair_ptr

    cdef const int64_t[::1] pair_ptr_v = pair_ptr
    cdef int16_t[::1] spd_v = spd
    cdef int16_t[::1] path_v = path_edges
    cdef int16_t[::1] degree_v = degree
    cdef int16_t* spd_p = &spd_v[0]
    cdef int16_t* path_p = &path_v[0]
    cdef int16_t* degree_p = &degree_v[0]
    cdef const int64_t* np_p = &node_ptr_v[0]
    cdef const int64_t* ep_p = &edge_ptr_v[0]
    cdef const int64_t* pp_p = &pair_ptr_v[0]
    cdef int failed = 0
    cdef int* failed_p = &failed        # shared flag: written through a pointer, not privatised
    cdef int64_t g
    cdef int32_t* ptr
    cdef int32_t* adj
    cdef int32_t* queue
    cdef int32_t* via
    with nogil, parallel(num_threads=threads):
        ptr = <int32_t*> malloc((max_n + 1) * sizeof(int32_t))
        adj = <int32_t*> malloc((2 * max_e + 1) * sizeof(int32_t))
        queue = <int32_t*> malloc((max_n + 1) * sizeof(int32_t))
        via = <int32_t*> malloc((max_n + 1) * sizeof(int32_t))
        if ptr == NULL or adj == NULL or queue == NULL or via == NULL:
            failed_p[0] = 1
        for g in prange(num_graphs, schedule="dynamic", chunksize=16):
            if ptr != NULL and adj != NULL and queue != NULL and via != NULL:
                _encode_graph(<int32_t> (np_p[g + 1] - np_p[g]), <int32_t> (ep_p[g + 1] - ep_p[g]),
                              src + ep_p[g], dst + ep_p[g], K, ptr, adj, queue, via,
                              spd_p + pp_p[g], path_p + pp_p[g] * K, degree_p + np_p[g])
        free(ptr)
        free(adj)
        free(queue)
        free(via)
    if failed:
        raise MemoryError("out of memory for the per-thread BFS scratch buffers")
    return spd, path_edges, degree, pair_ptr
