"""docs/settings.md is what dev/gen_settings_doc.py writes from the settings schemas."""

import importlib.util
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _generator():
    spec = importlib.util.spec_from_file_location(
        "gen_settings_doc", REPO / "dev" / "gen_settings_doc.py"
    )
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_the_settings_reference_is_current():
    gen = _generator()
    assert (REPO / "docs" / "settings.md").read_text() == gen.render(), (
        "docs/settings.md is stale: run `python dev/gen_settings_doc.py`"
    )


def test_the_reference_lists_every_setting_with_its_help():
    gen = _generator()
    text = gen.render()
    for cls, _title, _where, skip in gen.SECTIONS:
        inherited = set(skip.schema()) if skip is not None else set()
        for key in cls.schema():
            if key not in inherited:
                assert f"| `{key}` |" in text, f"{cls.__name__}.{key} missing"
    assert "| `lr` | `--lr` |" in text and "Peak learning rate" in text
