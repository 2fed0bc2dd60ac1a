"""Exports of a run: the HTML report and timelines for PyTorch's memory viewer."""
