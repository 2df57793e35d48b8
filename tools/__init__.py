"""deltaserve tools, by purpose.

* the load generator: ``loadgen.py`` (the command) over ``backends``, ``live``, ``metrics``,
  ``loadgen_report`` and the ``workloads`` package; ``soak_server.py`` soaks a server
* the cache-policy simulator: the ``sim`` package, run as ``python tools/simulate_cache.py``
* the benchmarks: the ``bench`` package, every one on ``bench/harness.py``
* the GPU device check ``gpu_check.py`` (its phases ``gpu_check_phases.py``), the model-folder
  and docs generators (``make_shaped_model.py``, ``qwen35_template.py``, ``gen_config_docs.py``)

Run them as scripts (``python tools/loadgen.py``); they import the project as
``deltaserve.*`` (installed by ``tools/setup.sh``), and this folder installs as
``deltaserve.tools``. ``workloads``, ``metrics`` and ``sim`` never import torch.
"""
