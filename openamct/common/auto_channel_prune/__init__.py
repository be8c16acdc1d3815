"""The base classes of ``auto_channel_prune_search``'s ``sensitivity=`` and ``search_alg=``
arguments, at upstream's module paths (``sensitivity_base``, ``search_channel_base``)."""
