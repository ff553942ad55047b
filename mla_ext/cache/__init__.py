"""Paged latent cache (SPEC §2, §6): write new tokens, gather context rows.

`reference` holds the float32 pure-PyTorch truth every backend is tested
against; `checks` the argument checks every backend shares; `api` the public
ops over the backend dispatcher.
"""
