"""Loading the data a run reads: step traces, experiment folders, and where they live.

``roots`` is the one lookup of the shared real data (``$STEPSYNTH_SHARED`` or
``../shared`` beside the repository) and of the embedded synthetic default dataset.
"""
