"""Property-based: recipe files and command-line overrides either give a valid TrainConfig or a
ConfigError with a message (never another exception)."""

from hypothesis import given, settings
from hypothesis import strategies as st

from redraft.errors import ConfigError
from redraft.train.config import FIELDS, load_recipe, make_config, parse_set

values = st.one_of(
    st.integers(-10, 10**6),
    st.floats(allow_nan=True, allow_infinity=True),
    st.booleans(),
    st.none(),
    st.text(max_size=8),
    st.lists(st.floats(-2, 2), max_size=3),
)
keys = st.sampled_from(sorted(FIELDS) + ["bogus_key"])


@settings(max_examples=300, deadline=None)
@given(overrides=st.dictionaries(keys, values, max_size=5))
def test_overrides_give_a_config_or_a_config_error(overrides):
    try:
        cfg = make_config(
            None,
            {
                k: v if not isinstance(v, (int, float, bool)) or v is None else str(v)
                for k, v in overrides.items()
            },
        )
    except ConfigError as exc:
        assert str(exc)
        return
    assert "bogus_key" not in overrides
    assert cfg.validate() is cfg


@settings(max_examples=200, deadline=None)
@given(items=st.lists(st.text(max_size=20), max_size=4))
def test_set_items_give_overrides_or_a_config_error(items):
    try:
        parse_set(items)
    except ConfigError as exc:
        assert str(exc)


@settings(max_examples=200, deadline=None)
@given(
    text=st.one_of(
        st.text(max_size=200),
        st.builds(
            lambda d: "\n".join(f"{k}: {v}" for k, v in d.items()),
            st.dictionaries(keys, values, max_size=5),
        ),
    )
)
def test_recipe_files_load_or_raise_a_config_error(tmp_path_factory, text):
    path = tmp_path_factory.mktemp("recipe") / "r.yaml"
    path.write_text(text)
    try:
        load_recipe(str(path))
    except ConfigError as exc:
        assert str(exc)
