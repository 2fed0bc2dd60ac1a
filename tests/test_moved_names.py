"""The engine's module names before its rooms (release 0.1.0) import, for one release, as
the modules themselves, with a DeprecationWarning that names the new place.

In a fresh interpreter each: which modules are already imported decides which path an
old name takes.
"""

from __future__ import annotations

import pytest

from pytest_torchmem.engine import MOVED
from test_plugin_imports import run_python


def test_an_old_module_name_is_the_moved_module_and_says_so() -> None:
    run_python(
        """
        import warnings

        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            from pytest_torchmem.engine.gpu_profiles import PROFILES
            import pytest_torchmem.engine.world.standins as standins
            import pytest_torchmem.engine.tracing.user_code as user_code
        from pytest_torchmem.engine.figures import gpu_profiles
        from pytest_torchmem.engine.user import standins as new_standins, user_code as new_user_code

        assert PROFILES is gpu_profiles.PROFILES
        assert standins is new_standins and user_code is new_user_code
        assert gpu_profiles.__spec__.name == "pytest_torchmem.engine.figures.gpu_profiles"
        said = [str(w.message) for w in caught if w.category is DeprecationWarning]
        assert said == [
            "pytest_torchmem.engine.gpu_profiles moved to pytest_torchmem.engine.figures.gpu_profiles; "
            "the old name goes in the release after 0.1.0",
            "pytest_torchmem.engine.world moved to pytest_torchmem.engine.user; "
            "the old name goes in the release after 0.1.0",
            "pytest_torchmem.engine.world.standins moved to pytest_torchmem.engine.user.standins; "
            "the old name goes in the release after 0.1.0",
            "pytest_torchmem.engine.tracing.user_code moved to pytest_torchmem.engine.user.user_code; "
            "the old name goes in the release after 0.1.0",
        ], said
        assert all(w.filename == "<string>" for w in caught), [w.filename for w in caught]
        """
    )


def test_an_old_module_name_is_an_attribute_of_the_engine() -> None:
    run_python(
        """
        import warnings

        import pytest_torchmem.engine as engine
        from pytest_torchmem.engine.figures import report

        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert engine.report is report
            from pytest_torchmem.engine import distinct_ranks
        from pytest_torchmem.engine import every_rank

        assert distinct_ranks is every_rank
        assert [w.category for w in caught] == [DeprecationWarning, DeprecationWarning]
        assert all(w.filename == "<string>" for w in caught), [w.filename for w in caught]
        try:
            engine.no_such_module
        except AttributeError as exc:
            assert "no_such_module" in str(exc)
        else:
            raise AssertionError("engine.no_such_module did not raise AttributeError")
        """
    )


@pytest.mark.parametrize(("room", "module", "name"), [("parallel", "mesh", "Parallel"), ("step", "built_in", "run_step"), ("measuring", "runs", "measure_step")])
def test_a_room_named_as_a_module_was_gives_its_names(room: str, module: str, name: str) -> None:
    """``engine/parallel.py`` is ``engine/parallel/``: its names, looked up on the room."""
    run_python(
        f"""
        import warnings

        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            from pytest_torchmem.engine.{room} import {name} as old
        from pytest_torchmem.engine.{room}.{module} import {name} as new

        assert old is new
        assert [str(w.message) for w in caught] == [
            "pytest_torchmem.engine.{room}.{name} moved to pytest_torchmem.engine.{room}.{module}.{name}; "
            "the old name goes in the release after 0.1.0"
        ], [str(w.message) for w in caught]
        try:
            from pytest_torchmem.engine.{room} import no_such_name
        except ImportError:
            pass
        else:
            raise AssertionError("no_such_name was found")
        """
    )


def test_every_old_name_leads_to_a_module_there_is() -> None:
    import importlib.util

    for old, new in MOVED.items():
        assert importlib.util.find_spec(new) is not None, (old, new)
        assert new.startswith("pytest_torchmem.engine."), new


def test_a_rooms_own_module_is_imported_alone() -> None:
    """``from pytest_torchmem.engine.parallel import threads`` imports threads, not the module
    whose names the room gives (``mesh``, with torch's distributed package behind it)."""
    run_python(
        """
        import sys
        import warnings

        warnings.simplefilter("error")
        from pytest_torchmem.engine.parallel import threads

        assert threads.__name__ == "pytest_torchmem.engine.parallel.threads"
        assert "pytest_torchmem.engine.parallel.mesh" not in sys.modules
        """
    )
