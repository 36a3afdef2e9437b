r"""A split's featurized and encoded graphs as flat arrays (:class:`FlatGraphs`), and the data sets
made into them: raw flat arrays (:func:`encode_flat`), PyG's collated storage
(:func:`flat_graphs_from_pyg`) and a featurized SMILES table of any size, streamed from and into
memory-mapped entries (:func:`encode_smiles_store`)."""
from __future__ import annotations

import os
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields

import numpy as np
import torch
from torch import Tensor

from graphormer_urpe.data.array_store import cached_entry
from graphormer_urpe.data.encodings import (ENCODING_BY_NAME, PATHS, Encoding, EncodingParams, encode, encodings_dir,
                                            entry_arrays, write_encodings)
from graphormer_urpe.data.feature_ids import FEATURE_ID_DTYPE, to_shared_ids
from graphormer_urpe.data.featurize import featurizer_spec


@dataclass(frozen=True)
class FlatGraphs:
    """``G`` featurized and encoded graphs as CSR-like flat arrays: numpy (possibly memory-mapped;
    row counts checked against the pointers) or, after :meth:`to`, torch tensors on one device.

    Attributes:
        x: ``[sum n, F]`` int16 shared atom ids (:mod:`.feature_ids`); graph ``g`` owns rows
            ``node_ptr[g]:node_ptr[g + 1]``.
        edge_attr: ``[sum E, Fe]`` int16 shared bond ids of the directed edges, in the order the
            encoder saw them (rows ``edge_ptr[g]:edge_ptr[g + 1]``).
        y: ``[G, T]`` float32 targets (NaN = unknown).
        pair_ptr: ``[G + 1]`` int64 node-pair rows, ``n_g^2`` per graph (pair ``(i, j)`` at ``i n_g + j``).
        encodings: name -> stored array, in the layout of :mod:`~.encodings` (path edges as LOCAL
            edge ids)."""

    x: np.ndarray | Tensor
    node_ptr: np.ndarray | Tensor
    edge_attr: np.ndarray | Tensor
    edge_ptr: np.ndarray | Tensor
    y: np.ndarray | Tensor
    pair_ptr: np.ndarray | Tensor
    encodings: dict[str, np.ndarray | Tensor]

    def __post_init__(self) -> None:
        if isinstance(self.x, Tensor):  # made by :meth:`to` from checked arrays
            return
        g = len(self.node_ptr) - 1
        n = np.diff(self.node_ptr)
        rows = {"node": self.node_ptr[-1], "pair": self.pair_ptr[-1]}
        checks = {
            "edge_ptr": len(self.edge_ptr) == g + 1,
            "pair_ptr": len(self.pair_ptr) == g + 1,
            "y rows": self.y.ndim == 2 and self.y.shape[0] == g,
            "x rows": self.x.ndim == 2 and self.x.shape[0] == self.node_ptr[-1],
            "edge_attr rows": self.edge_attr.ndim == 2 and self.edge_attr.shape[0] == self.edge_ptr[-1],
            **{f"{name} rows": name in ENCODING_BY_NAME and values.ndim == 1 + bool(ENCODING_BY_NAME[name].width)
               and values.shape[0] == rows[ENCODING_BY_NAME[name].per] for name, values in self.encodings.items()},
            "pair_ptr = cumsum(n^2)": g == 0 or np.array_equal(np.diff(self.pair_ptr), n * n),
        }
        bad = [name for name, ok in checks.items() if not ok]
        if bad:
            raise ValueError(f"inconsistent FlatGraphs arrays: {', '.join(bad)}")

    def specs(self) -> list[tuple[Encoding, np.ndarray | Tensor]]:
        return [(ENCODING_BY_NAME[name], values) for name, values in self.encodings.items()]

    def __len__(self) -> int:
        return len(self.node_ptr) - 1

    @property
    def num_nodes(self) -> np.ndarray | Tensor:
        return self.node_ptr[1:] - self.node_ptr[:-1]

    @property
    def num_edges(self) -> np.ndarray | Tensor:
        return self.edge_ptr[1:] - self.edge_ptr[:-1]

    @property
    def device(self) -> torch.device:
        return self.x.device if isinstance(self.x, Tensor) else torch.device("cpu")

    def to(self, device: torch.device | str = "cpu") -> "FlatGraphs":
        """The graphs as torch tensors on ``device``, dtypes kept (on the CPU a copy, off any memory map)."""
        device = torch.device(device)

        def tensor(array: np.ndarray) -> Tensor:
            with warnings.catch_warnings():  # read-only maps: torch warns about writes we never make
                warnings.simplefilter("ignore", UserWarning)
                values = torch.from_numpy(np.asarray(array))
            return values.to(device, copy=device.type == "cpu")

        return FlatGraphs(**{f.name: tensor(getattr(self, f.name)) for f in fields(self) if f.name != "encodings"},
                          encodings={name: tensor(values) for name, values in self.encodings.items()})


def flat_graphs(x_ids: np.ndarray, node_ptr: np.ndarray, edge_attr_ids: np.ndarray, edge_ptr: np.ndarray,
                 y: np.ndarray, encoded: Mapping[str, np.ndarray], params: EncodingParams) -> FlatGraphs:
    return FlatGraphs(x=x_ids, node_ptr=node_ptr, edge_attr=edge_attr_ids, edge_ptr=edge_ptr,
                      y=np.asarray(y, dtype=np.float32).reshape(len(node_ptr) - 1, -1),
                      pair_ptr=encoded["pair_ptr"], encodings={e.name: encoded[e.name] for e in params.encodings()})


def encode_flat(
    x: np.ndarray, node_ptr: np.ndarray, edge_index: np.ndarray, edge_attr: np.ndarray,
    edge_ptr: np.ndarray, y: np.ndarray, *, params: EncodingParams, atom_feature_dims: Sequence[int],
    bond_feature_dims: Sequence[int], num_threads: int = 1, cache: tuple[str | os.PathLike, str] | None = None,
    encoded: Mapping[str, np.ndarray] | None = None,
) -> FlatGraphs:
    """Featurize (shared ids) and encode raw flat graphs: ``x [sum n, F]`` and ``edge_attr [sum E,
    Fe]`` raw values (or one column flat), ``edge_index [2, sum E]`` LOCAL node ids, ``y [G, T]``.
    ``cache = (base, split)``: each encoder's arrays through its cache entry, else in memory;
    ``encoded``: those arrays already computed."""
    node_ptr = np.ascontiguousarray(node_ptr, dtype=np.int64)
    edge_ptr = np.ascontiguousarray(edge_ptr, dtype=np.int64)
    if encoded is None:
        encoded = encode(node_ptr, edge_index, edge_ptr, params, num_threads, cache)
    return flat_graphs(to_shared_ids(x, atom_feature_dims, "atom"), node_ptr,
                       to_shared_ids(edge_attr, bond_feature_dims, "bond"), edge_ptr, y, encoded, params)


def flat_graphs_from_pyg(dataset, cache: tuple[str | os.PathLike, str], params: EncodingParams,
                         atom_feature_dims: Sequence[int], bond_feature_dims: Sequence[int],
                         num_threads: int = 1) -> FlatGraphs:
    """:class:`FlatGraphs` of a PyG ``InMemoryDataset`` straight from its collated storage (node ids
    already local per graph), its encodings cached under ``cache = (base, split)``."""
    data, slices = dataset._data, dataset.slices
    if slices is None:  # a dataset of one graph
        slices = {"x": torch.tensor([0, data.num_nodes]), "edge_index": torch.tensor([0, data.edge_index.shape[1]])}
    return encode_flat(
        data.x.numpy(), slices["x"].numpy(), data.edge_index.numpy(), data.edge_attr.numpy(),
        slices["edge_index"].numpy(), data.y.numpy(), cache=cache, params=params,
        atom_feature_dims=atom_feature_dims, bond_feature_dims=bond_feature_dims, num_threads=num_threads,
    )


def encode_smiles_store(arrays: Mapping[str, np.ndarray], checksums: Mapping[str, str],
                        cache: tuple[str | os.PathLike, str],
                        params: EncodingParams, featurizer: str, num_threads: int = 1) -> FlatGraphs:
    """:class:`FlatGraphs` of the distinct molecules of a featurized SMILES table
    (:func:`~.featurize.cached_smiles_graphs`; ``y`` NaN: targets live per row). The shared ids and
    shortest-path encodings stream into ONE cache entry, each other encoder into its own, chunk by
    chunk, keyed by the featurized entry's ``checksums`` (:func:`~.array_store.checksums`): memory
    stays bounded and every array returned is memory-mapped."""
    spec = featurizer_spec(featurizer)
    num_graphs = len(arrays["node_ptr"]) - 1
    y = np.full((num_graphs, 1), np.nan, np.float32)
    features = {"x": spec.atom_feature_dims, "edge_attr": spec.bond_feature_dims}
    source = {name: checksums[name] for name in ("node_ptr", "edge_ptr", "edge_index", *features)}
    fingerprint = {**PATHS.fingerprint(params, source), "feature_dims": {k: list(v) for k, v in features.items()}}

    def build(writer) -> None:
        write_encodings(writer, arrays["node_ptr"], arrays["edge_index"], arrays["edge_ptr"], params,
                        num_threads, progress=True)
        for name, dims in features.items():
            kind = "atom" if name == "x" else "bond"
            writer.write(name, arrays[name], lambda rows: to_shared_ids(rows, dims, kind), FEATURE_ID_DTYPE)

    encoded = dict(cached_entry(encodings_dir(*cache, params), fingerprint, build,
                                expect=(*entry_arrays(PATHS), *features)))
    encoded.update(encode(arrays["node_ptr"], arrays["edge_index"], arrays["edge_ptr"], params, num_threads,
                          cache, source, skip=PATHS))
    return flat_graphs(encoded["x"], arrays["node_ptr"], encoded["edge_attr"], arrays["edge_ptr"], y, encoded,
                        params)
