"""What tests and benchmarks share: the virtual multi-node cluster and the train functions
both run on it. Both import it (``from harness.netns import NetnsCluster``); it imports
neither, only ``ray_mesh``
(``tests/unit/test_architecture.py`` holds that).

* :mod:`.netns`: a virtual Tailscale cluster on one Linux machine (per node a network and
  a private mount namespace, a real WireGuard ``tailscale0`` over a LAN veth, Ray started
  with ``deploy/tailscale``'s scripts);
* :mod:`.ckpt_train`: the checkpoint and recovery train function (a SIGKILL mid-run, the
  resume read back from its log);
* :mod:`.hang_train`: the train loop in which one rank skips a collective.

It lives at the top of the repository, beside ``tests/`` and ``benchmarks/``, so that
``python -m pytest`` and ``python benchmarks/run.py`` from the repository root, and the
cluster's drivers (``PYTHONPATH`` is the repository), all import it the same way. It is not
part of the installed package.
"""
