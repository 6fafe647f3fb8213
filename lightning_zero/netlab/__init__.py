"""A network lab where bytes cost: simulated nodes on rate-limited links (``lightning-zero-netlab``).

``rates`` parses message sizes and sizes tc's token buckets (link rates: ``lightning_zero.comm.rates``); ``topology``
lays the lab out as data (namespaces, veths, a bridge, addresses from 198.18.0.0/15); ``lab`` builds and removes it;
``launch`` starts a command's ranks on its nodes with torchrun; ``check`` measures it; ``cli`` is the command line.
Linux only, as root, with ``ip`` and ``tc`` from iproute2.
"""
