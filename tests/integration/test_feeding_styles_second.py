"""The second kernel of test_feeding_styles.py's cases (every other one): in a file of its own, so that pytest's
two workers run the two kernels side by side."""

from __future__ import annotations

import pytest
from test_feeding_styles import GROUPS, check_case, group_results

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]  # a group's kernel calibrates in its first test


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return group_results(GROUPS[1], tmp_path_factory)


@pytest.mark.parametrize("case", GROUPS[1])
def test_each_feeding_style_and_model_kind_profiles_predicts_and_calibrates(results, case):
    check_case(results(case), case)
