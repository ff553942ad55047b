"""mla_ext inside SGLang, without editing SGLang.

`plugin.register` is SGLang's general-plugin hook (entry point group
``sglang.srt.plugins``, name ``mla_ext``); it imports nothing from SGLang until
SGLang calls it and changes nothing unless asked (``MLA_EXT_SGLANG=1`` or
``SGLANG_PLUGINS`` naming ``mla_ext``). What it then takes over is DeepSeek's
chunked-prefix prefill (`chunked_prefix.py`) and the absorbed-vs-MHA choice of
the fa3 / flashinfer / flashmla handlers (`dispatch.py`).
"""
