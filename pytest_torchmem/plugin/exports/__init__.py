"""Exports of a run: the HTML report and timelines for PyTorch's memory viewer.

:mod:`.html_report` turns each check into a view and writes the report,
:mod:`.html_page` renders the page; :mod:`.memory_viz` writes a traced step as a
snapshot that PyTorch's memory viewer opens. The plugin writes them where asked
(``--torchmem-html``, ``--torchmem-timeline``).
"""

__all__: list[str] = []
