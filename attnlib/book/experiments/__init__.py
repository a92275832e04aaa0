"""Experiments the book reports: each runs from the command line and writes a results file."""
