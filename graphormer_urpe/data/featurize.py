r"""SMILES -> molecular graph featurizers, named so a checkpoint can redo featurization from its
name alone, and the parallel, streaming drivers over many SMILES.

- ``"zinc"``: the ZINC benchmark's 28 atom tokens (:data:`ZINC_ATOM_TOKENS`) and the kekulized
  bond type 1/2/3;
- ``"ogb"``: OGB's ``smiles2graph`` (9 atom columns, 3 bond columns), as used by PCQM4Mv2.

Both give directed edges in both directions with LOCAL node ids."""
from __future__ import annotations

import contextlib
import functools
import hashlib
import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from tqdm import tqdm

from graphormer_urpe.utils.workers import WorkerProcesses, useful_workers

#: The ZINC benchmark's atom vocabulary, in id order (= ``atom_dict.json`` of the raw data).
ZINC_ATOM_TOKENS: tuple[str, ...] = (
    "C", "O", "N", "F", "C H1", "S", "Cl", "O -", "N H1 +", "Br", "N H3 +", "N H2 +", "N +", "N -",
    "S -", "I", "P", "O H1 +", "N H1 -", "O +", "S +", "P H1", "P H2", "C H2 -", "P +", "S H1 +",
    "C H1 -", "P H1 +",
)
_ZINC_TOKEN_IDS = {token: i for i, token in enumerate(ZINC_ATOM_TOKENS)}
ZINC_ATOM_FEATURE_DIMS: tuple[int, ...] = (len(ZINC_ATOM_TOKENS),)
#: Bond type 0 (none) .. 3 (triple).
ZINC_BOND_FEATURE_DIMS: tuple[int, ...] = (4,)
#: ``ogb.utils.features.get_{atom,bond}_feature_dims()``.
OGB_ATOM_FEATURE_DIMS: tuple[int, ...] = (119, 5, 12, 12, 10, 6, 6, 2, 2)
OGB_BOND_FEATURE_DIMS: tuple[int, ...] = (5, 6, 2)


def clean_smiles(smiles: str) -> str:
    """``smiles`` without surrounding white space; ``ValueError`` for white space left inside (RDKit
    would silently read only up to it; a CXSMILES ``"<smiles> |...|"`` is read whole) and for a
    character that is not ASCII (RDKit drops some without a word)."""
    if not isinstance(smiles, str):
        raise ValueError(f"SMILES must be a string, got {type(smiles).__name__}")
    stripped = smiles.strip()
    core, _, extension = stripped.partition(" ")
    if any(c.isspace() for c in core) or (
            extension and not (len(extension) > 1 and extension[0] == extension[-1] == "|")):
        raise ValueError(f"SMILES {smiles!r} contains white space (RDKit would read only "
                         f"{stripped.split()[0]!r})")
    if not core.isascii():
        position, character = next((i, c) for i, c in enumerate(core) if not c.isascii())
        raise ValueError(f"SMILES {smiles!r} has a character that is not ASCII ({character!r} at "
                         f"position {position + 1}); RDKit would drop it or misread the molecule")
    return stripped


def _parse(smiles: str):
    from rdkit import Chem

    smiles = clean_smiles(smiles)
    mol = Chem.MolFromSmiles(smiles) if smiles else None
    if mol is None:
        raise ValueError(f"RDKit cannot parse SMILES {smiles!r}")
    return mol


def zinc_atom_token(atom) -> str:
    """The ZINC atom token of an RDKit atom: the element, ``" H<n>"`` for explicit hydrogens unless a
    neutral aromatic atom (``[nH]`` is ``"N"``), ``" +"`` / ``" -"`` for a charge (``" -2"`` for two,
    outside the vocabulary: never aliased)."""
    token = atom.GetSymbol()
    charge = atom.GetFormalCharge()
    hydrogens = atom.GetNumExplicitHs()
    if hydrogens and not (atom.GetIsAromatic() and charge == 0):
        token += f" H{hydrogens}"
    if charge:
        token += (" +" if charge > 0 else " -") + (str(abs(charge)) if abs(charge) > 1 else "")
    return token


def smiles_to_zinc_dense(smiles: str) -> tuple[np.ndarray, np.ndarray]:
    """``(atom_type uint8 [n], bond_type uint8 [n, n])``, the layout of ZINC's raw pickles."""
    from rdkit import Chem

    mol = _parse(smiles)
    n = mol.GetNumAtoms()
    try:  # atoms by index: RDKit's GetAtoms() sequence wrapper costs time on every molecule
        atom_type = np.fromiter((_ZINC_TOKEN_IDS[zinc_atom_token(mol.GetAtomWithIdx(i))] for i in range(n)),
                                dtype=np.uint8, count=n)
    except KeyError as err:
        raise ValueError(f"atom token {err.args[0]!r} of {smiles!r} is not in the ZINC vocabulary") from None
    Chem.Kekulize(mol, clearAromaticFlags=True)
    bond_type = Chem.GetAdjacencyMatrix(mol, useBO=True).astype(np.uint8)  # kekulized: 1, 2, 3
    return atom_type, bond_type


def smiles_to_zinc_graph(smiles: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(x [n, 1], edge_index [2, E], edge_attr [E, 1])``, edges as PyG's ``ZINC.process()`` orders them."""
    atom_type, bond_type = smiles_to_zinc_dense(smiles)
    src, dst = np.nonzero(bond_type)
    return atom_type.reshape(-1, 1), np.stack([src, dst]).astype(np.int64), bond_type[src, dst].reshape(-1, 1)


def smiles_to_ogb_graph(smiles: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(x [n, 9], edge_index [2, E], edge_attr [E, 3])`` from ``ogb.utils.smiles2graph``."""
    from ogb.utils import smiles2graph

    _parse(smiles)  # smiles2graph fails with an AttributeError on what RDKit rejects
    graph = smiles2graph(clean_smiles(smiles))
    return graph["node_feat"], graph["edge_index"], graph["edge_feat"]


@dataclass(frozen=True)
class FeaturizerSpec:
    """How SMILES become graphs for one data family."""

    name: str
    atom_feature_dims: tuple[int, ...]
    bond_feature_dims: tuple[int, ...]
    #: ``smiles -> (x [n, F], edge_index [2, E], edge_attr [E, Fe])``; ValueError when rejected.
    graph_arrays: Callable[[str], tuple[np.ndarray, np.ndarray, np.ndarray]]


FEATURIZERS: dict[str, FeaturizerSpec] = {
    "zinc": FeaturizerSpec("zinc", ZINC_ATOM_FEATURE_DIMS, ZINC_BOND_FEATURE_DIMS, smiles_to_zinc_graph),
    "ogb": FeaturizerSpec("ogb", OGB_ATOM_FEATURE_DIMS, OGB_BOND_FEATURE_DIMS, smiles_to_ogb_graph),
}


def featurizer_spec(name: str) -> FeaturizerSpec:
    """The featurizer called ``name`` (``"zinc"`` or ``"ogb"``)."""
    if name not in FEATURIZERS:
        raise ValueError(f"unknown featurizer {name!r}; expected one of {sorted(FEATURIZERS)}")
    return FEATURIZERS[name]


@dataclass
class FeaturizedChunk:
    """A chunk of SMILES as flat graphs in input order (``position``: each graph's SMILES in the
    chunk; ``x``, ``edge_attr`` uint8, ``edge_index`` local ids), raw RDKit descriptors when asked
    for, and ``(position, reason)`` of each SMILES without a graph (``too_large``: those over the
    size limit)."""

    position: np.ndarray
    x: np.ndarray
    node_ptr: np.ndarray
    edge_index: np.ndarray
    edge_attr: np.ndarray
    edge_ptr: np.ndarray
    errors: list[tuple[int, str]]
    too_large: list[int]
    descriptors: np.ndarray | None = None

    def take(self, graphs: np.ndarray) -> FeaturizedChunk:
        """The chunk of ``graphs`` (indices into this one's, in that order)."""
        def ranges(ptr: np.ndarray) -> np.ndarray:  # the positions of each graph's nodes or edges
            counts = np.diff(ptr)[graphs]
            ends = np.cumsum(counts)
            return np.repeat(ptr[graphs] - ends + counts, counts) + np.arange(ends[-1] if len(ends) else 0)

        nodes, edges = ranges(self.node_ptr), ranges(self.edge_ptr)
        ptr = lambda old: np.concatenate([[0], np.cumsum(np.diff(old)[graphs])])  # noqa: E731
        return FeaturizedChunk(self.position[graphs], self.x[nodes], ptr(self.node_ptr), self.edge_index[:, edges],
                               self.edge_attr[edges], ptr(self.edge_ptr), [], [],
                               None if self.descriptors is None else self.descriptors[graphs])


def featurize_chunk(featurizer: str, smiles: Sequence[str], max_atoms: int | None = None,
                    descriptors: bool = False) -> FeaturizedChunk:
    """The graphs of ``smiles`` (in worker processes; the data builds and prediction featurize here):
    an empty SMILES, one RDKit or the featurizer rejects, one over ``max_atoms`` and, with
    ``descriptors``, one that gets no RDKit descriptor get their reason in ``errors`` instead."""
    from rdkit import Chem, RDLogger

    RDLogger.DisableLog("rdApp.*")  # the reasons are reported instead, by the caller
    spec = featurizer_spec(featurizer)
    graphs, errors, too_large = [], [], []
    for position, text in enumerate(smiles):
        if not text.strip():
            errors.append((position, "empty SMILES"))
            continue
        # a SMILES longer than max_atoms (every atom takes a character) may be too large: its heavy
        # atoms are counted first, from a parse without sanitization (cheap even for a huge polymer)
        atoms = 0
        if max_atoms is not None and len(text) > max_atoms:
            mol = Chem.MolFromSmiles(text, sanitize=False)
            atoms = 0 if mol is None else sum(atom.GetAtomicNum() != 1 for atom in mol.GetAtoms())
        if max_atoms is None or atoms <= max_atoms:
            try:
                x, edge_index, edge_attr = spec.graph_arrays(text)
            except ValueError as exc:
                errors.append((position, str(exc)))
                continue
            atoms = len(x)  # hydrogens kept as atoms count too
        if max_atoms is not None and atoms > max_atoms:
            errors.append((position, f"molecule has {atoms} atoms, more than max_nodes={max_atoms}"))
            too_large.append(position)
            continue
        graphs.append((position, x, edge_index, edge_attr))
    values = None
    if descriptors:
        from graphormer_urpe.data.descriptors import descriptor_chunk

        values = descriptor_chunk([smiles[g[0]] for g in graphs])
        none = np.isnan(values).all(axis=1)
        errors = sorted(errors + [(g[0], "RDKit computes none of the molecule's descriptors")
                                  for g, bad in zip(graphs, none) if bad])
        graphs, values = [g for g, bad in zip(graphs, none) if not bad], values[~none]

    def joined(part: int, empty: np.ndarray, axis: int = 0) -> np.ndarray:  # from the shape of no graph
        return np.concatenate([empty, *(g[part] for g in graphs)], axis=axis).astype(empty.dtype)

    return FeaturizedChunk(
        position=np.array([g[0] for g in graphs], dtype=np.int64),
        x=joined(1, np.zeros((0, len(spec.atom_feature_dims)), np.uint8)),
        node_ptr=np.concatenate([[0], np.cumsum([len(g[1]) for g in graphs], dtype=np.int64)]),
        edge_index=joined(2, np.zeros((2, 0), np.int64), axis=1),
        edge_attr=joined(3, np.zeros((0, len(spec.bond_feature_dims)), np.uint8)),
        edge_ptr=np.concatenate([[0], np.cumsum([g[2].shape[1] for g in graphs], dtype=np.int64)]),
        errors=errors, too_large=too_large, descriptors=values)


def _apply(job: tuple[Callable, Any]) -> Any:
    function, argument = job
    return function(argument)


@contextlib.contextmanager
def worker_pool(num_workers: int | None) -> Iterator[WorkerProcesses | None]:
    """``num_workers`` worker processes (default and at most: the usable cores), or None for one.
    Start them BEFORE reading a large input, so they share none of its pages."""
    num_workers = useful_workers(num_workers)
    if num_workers <= 1:
        yield None
        return
    with WorkerProcesses(num_workers, _apply) as pool:
        yield pool


def map_chunks(function: Callable, items: Sequence, chunk_size: int, num_workers: int | None, desc: str,
               pool: WorkerProcesses | None = None) -> Iterator:
    """``function`` of each run of ``chunk_size`` consecutive ``items`` (sliced lazily), in order, over
    ``pool`` or ``num_workers`` processes, with a tqdm bar counting items; at most two chunks per
    worker are sliced ahead. A stop (Ctrl-C, SIGTERM) ends the workers before it is raised here."""
    starts = range(0, len(items), chunk_size)
    chunks = (list(items[s:s + chunk_size]) for s in starts)
    sizes = [min(chunk_size, len(items) - s) for s in starts]
    with tqdm(total=len(items), desc=desc, unit="mol") as bar, contextlib.ExitStack() as stack:
        if pool is None and len(sizes) > 1:
            pool = stack.enter_context(worker_pool(useful_workers(num_workers, len(sizes))))
        if pool is None:
            results = map(function, chunks)
        else:
            jobs = ((None, (function, chunk)) for chunk in chunks)
            results = (result for _, result in pool.imap(jobs, ahead=2 * pool.workers + 1))
        for result, size in zip(results, sizes):
            yield result
            bar.update(size)


#: ``graph_of_row`` of a row whose SMILES RDKit rejects (or is missing), and of one too large.
REJECTED_ROW, TOO_LARGE_ROW = -1, -2


def file_fingerprint(path: str | os.PathLike, data: bytes | None = None) -> dict:
    """Name, size and BLAKE2 hash of a source file (what a featurized cache depends on), of its bytes
    ``data`` where they are read already."""
    digest = hashlib.blake2b(data or b"", digest_size=16)
    if data is None:
        with open(path, "rb") as f:
            hashlib.file_digest(f, lambda: digest)
    return {"name": os.path.basename(path), "size": os.path.getsize(path) if data is None else len(data),
            "blake2b": digest.hexdigest()}


#: Arrays of a featurized SMILES table entry (:func:`cached_smiles_graphs`).
SMILES_GRAPH_ARRAYS = ("x", "node_ptr", "edge_index", "edge_attr", "edge_ptr", "graph_of_row", "y")


def cached_smiles_graphs(directory: str | os.PathLike, source_fingerprint: dict,
                         read_table: Callable[[], tuple[Sequence[str], np.ndarray]], featurizer: str,
                         num_workers: int | None = None, chunk_size: int = 1000,
                         max_atoms: int | None = None) -> dict[str, np.ndarray]:
    """A SMILES table featurized once into the array-store entry ``directory``, keyed by
    ``source_fingerprint``, the featurizer and the RDKit/OGB versions (``read_table() -> (smiles,
    y)`` is called only to build it). Arrays (memory-mapped): the distinct accepted molecules'
    ``x``, ``node_ptr``, ``edge_index`` int16 (local ids), ``edge_attr``, ``edge_ptr``, and per row
    ``graph_of_row`` (:data:`REJECTED_ROW`, :data:`TOO_LARGE_ROW`) and ``y``. The build streams
    chunks from the workers into the entry's files: memory holds the table, ``O(R)`` integers and a
    few chunks per worker."""
    import ogb
    import rdkit

    from graphormer_urpe.data.array_store import cached_entry

    fingerprint = {"kind": "featurized smiles", "featurizer": featurizer, "source": source_fingerprint,
                   "rdkit": rdkit.__version__, "ogb": ogb.__version__}
    if max_atoms is not None:
        fingerprint["max_atoms"] = int(max_atoms)

    def build(writer) -> None:
        import pandas as pd

        spec = featurizer_spec(featurizer)
        int16_max = np.iinfo(np.int16).max
        with worker_pool(num_workers) as pool:  # forked before the table exists (see worker_pool)
            smiles, y = read_table()
            writer.write("y", np.asarray(y, dtype=np.float32).reshape(len(smiles), -1))
            # each row's distinct SMILES (codes, -1 = missing), in first-occurrence order
            codes, distinct = pd.factorize(pd.Series(smiles, dtype=object), use_na_sentinel=True)
            distinct = np.asarray(distinct, dtype=object)
            del smiles, y
            x = writer.array("x", np.uint8, (len(spec.atom_feature_dims),))
            edge_index = writer.array("edge_index", np.int16, (2,), axis=1)
            edge_attr = writer.array("edge_attr", np.uint8, (len(spec.bond_feature_dims),))
            node_counts, edge_counts, rejected, too_large = [], [], [], []
            start = 0  # the chunk's first distinct SMILES
            for chunk in map_chunks(functools.partial(featurize_chunk, featurizer, max_atoms=max_atoms), distinct,
                                    chunk_size, num_workers, f"featurize ({featurizer})", pool):
                n = np.diff(chunk.node_ptr)
                if len(n) and n.max() > int16_max:
                    raise ValueError(f"a molecule has more than {int16_max} atoms")
                x.append(chunk.x)
                edge_index.append(chunk.edge_index)
                edge_attr.append(chunk.edge_attr)
                node_counts.append(n.astype(np.int32))
                edge_counts.append(np.diff(chunk.edge_ptr).astype(np.int32))
                over = set(chunk.too_large)
                rejected.append(np.array([start + p for p, _ in chunk.errors if p not in over], dtype=np.int64))
                too_large.append(start + np.array(chunk.too_large, dtype=np.int64))
                start += chunk_size
        for name, counts in (("node_ptr", node_counts), ("edge_ptr", edge_counts)):
            counts = np.concatenate(counts) if counts else np.zeros(0, np.int32)
            writer.write(name, np.concatenate([[0], np.cumsum(counts, dtype=np.int64)]))
        accepted = np.ones(len(distinct), dtype=bool)
        for rows in (*rejected, *too_large):
            accepted[rows] = False
        graph_of_distinct = np.where(accepted, np.cumsum(accepted) - 1, REJECTED_ROW)
        for rows in too_large:
            graph_of_distinct[rows] = TOO_LARGE_ROW
        writer.write("graph_of_row", np.where(codes >= 0, graph_of_distinct[np.maximum(codes, 0)],
                                              REJECTED_ROW).astype(np.int64))

    return cached_entry(directory, fingerprint, build, expect=SMILES_GRAPH_ARRAYS)
