"""The ground floor, below every other room, imported by all and importing none of them:
:mod:`.files` (the one way a file is put in place, several together, folders built whole or not
at all, the input checks, every lock: the ``filelock`` package's), :mod:`.process` (the
usable CPU cores; stopping on signals and the exit statuses every command shares),
:mod:`.workers` (worker processes that a stop or a lost worker never leaves waiting: the data
builds' and the prediction's), :mod:`.torch_files` (every torch file read as data, never
code), :mod:`.extras` (the optional extras) and :mod:`.lightning_private` (the
private parts of Lightning the package relies on, named in one place and checked by a test)."""
