"""The README's table of `%tfmem` commands and the magic's command table (`COMMANDS`, which also gives the dispatch
and `%tfmem help`) list the same commands, and mark `-o` on the same ones: neither can drift from the other."""

import re
from pathlib import Path

from tfmem_magic.adapters.magics import COMMANDS, help_text

README = Path(__file__).resolve().parents[2] / "README.md"


def readme_rows() -> dict[str, str]:
    """{command name: its first cell} for each row of the README's "`%tfmem` commands" table."""
    section = README.read_text().split("### `%tfmem` commands", 1)[1]
    rows = {}
    for line in section.split("\n\n", 2)[1].splitlines():  # the table: the first block after the heading
        first = line.split(" | ")[0]
        found = re.match(r"\| `%tfmem (\w+)", first)
        if found:
            rows[found.group(1)] = first
    return rows


def test_the_readme_lists_exactly_the_commands_of_the_table():
    assert list(readme_rows()) == list(COMMANDS)


def test_the_readme_marks_o_on_the_commands_that_return_an_object():
    marked = {name for name, cell in readme_rows().items() if "[-o]" in cell}
    assert marked == {name for name, command in COMMANDS.items() if command.returns}
    assert marked  # the -o convention is documented at all


def test_help_lists_every_command_with_its_usage():
    text = help_text()
    assert all(f"%tfmem {command.usage}" in text for command in COMMANDS.values())


def readme_options() -> set[str]:
    """Every option the README's "`%%tfmem` options" table names in its first column."""
    section = README.read_text().split("### `%%tfmem` options", 1)[1]
    table = section.split("\n\n", 2)[1]  # the first block after the heading
    return {option for line in table.splitlines() for option in re.findall(r"`(--[\w-]+)", line.split(" | ")[0])}


def test_the_readme_lists_exactly_the_options_of_the_parser():
    from tfmem_magic.adapters.arguments import build_parser

    parsed = {s for action in build_parser()._actions for s in action.option_strings if s.startswith("--")}
    assert readme_options() == parsed - {"--help"}
