"""Print the manual's table of presets (docs/concepts/presets.md): every registered method's presets, field by field, with their sources.

    python scripts/presets_table.py      # paste into docs/concepts/presets.md (tests/test_presets.py checks it)
"""
from fewclip.adapter.base import ADAPTERS, adapter_info
from fewclip.config.presets import markdown_rows
from fewclip.runs.run import preset_defaults

if __name__ == "__main__":
    names = ADAPTERS.names()
    print("\n".join(markdown_rows(names, {n: preset_defaults(adapter_info(n)) for n in names})))
