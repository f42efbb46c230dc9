"""The applications layer's private parts: the estimator behind ``infinity.estimate``, the
train job's data reading behind ``infinity.train``, and the run-model harness of the scripts.
The public faces (``train``, ``estimate``, ``export``, ``testing``, ``integrations``) import from
here and from the layers below."""
