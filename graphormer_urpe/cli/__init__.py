"""Every console command, one thin module each: its arguments, its refusals (one line, exit
status 2, before any long work), the library call that does the work, and what it prints.

==================  ==============================  ============================================
module              command                         the library it drives
==================  ==============================  ============================================
``fit``             ``graphormer-urpe``             :mod:`graphormer_urpe.training.lightning_cli`
``ablation``        ``graphormer-urpe-ablation``    :mod:`graphormer_urpe.training.studies`
``hpopt``           ``graphormer-urpe-hpopt``       :mod:`graphormer_urpe.training.studies`
``synthetic``       ``graphormer-urpe-synthetic``   :mod:`graphormer_urpe.training.studies`
``plot``            ``graphormer-urpe-plot``        :mod:`graphormer_urpe.cli.learned_tables`
``submit``          ``graphormer-urpe-submit``      :mod:`graphormer_urpe.training.submission`
``predict``         ``graphormer-urpe-predict``     :mod:`graphormer_urpe.prediction`
``explain``         ``graphormer-urpe-explain``     :mod:`graphormer_urpe.prediction`
``export``          ``graphormer-urpe-export``      :mod:`graphormer_urpe.prediction.pretrained`
==================  ==============================  ============================================

A new command is a module here with a ``main(argv) -> int`` and its line in ``pyproject.toml``'s
``[project.scripts]``; what it does belongs in a room below, except the files only it writes
(``predict``'s embeddings arrays, ``explain``'s pictures and page, ``export``'s backbone file,
the figures of the learned tables of ``plot`` and ``ablation --figures``: :mod:`.learned_tables`).
"""
