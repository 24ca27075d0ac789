"""Method configs for the tests that run every registered method: each method's defaults, except the searches
that would make one method cost minutes there. ProLIP's default searches 7 learning rates x 7 regulariser weights,
each a 300-step fit (49 fits); here 2 x 2 fits of 30 steps run the same search, fit and selection code. Its full
search code is matched to the authors' by tests/parity/test_gda_proker_prolip.py and its default grid is run by
tests/test_cache_methods.py."""
from fewclip.adapter.base import AdapterConfig, adapter_info

SMALL = {"prolip": {"lrs": [1e-3, 1e-5], "lambdas": [1.0, 0.0], "epochs": 30}}


def small_config(name: str) -> AdapterConfig:
    """``name``'s config: its defaults, with the overrides in ``SMALL``."""
    return adapter_info(name).config_cls(**SMALL.get(name, {}))
