"""Imports every module of fuzz cases (each registers its cases on import)."""
import fuzz_cases_attention  # noqa: F401
import fuzz_cases_cache  # noqa: F401
import fuzz_cases_config  # noqa: F401
import fuzz_cases_host  # noqa: F401
import fuzz_cases_kv_b_proj  # noqa: F401
import fuzz_cases_offsets  # noqa: F401
import fuzz_cases_sparse  # noqa: F401
import fuzz_cases_sparse_routing  # noqa: F401
