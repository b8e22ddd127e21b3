"""The prepare_data stage's job: every source (a hub dataset, a local file or folder, the
embedded synthetic set in `synth`) reduced to one MathVista-schema row format, with the prompt
each row is shown (`prompts`), before anything else sees it.

- `sources`: rows from where the data lives, bad lines kept with their file and line.
- `columns`: a dataset's column names and answer pattern as params; ids and types derived.
- `prepare`: validation, filters, images, the train/eval split and the data report.
- `prompts`: the one prompt builder that training, evaluation and export share.
- `synth`: the synthetic visual-maths set the embedded default trains on.

No torch at import."""
