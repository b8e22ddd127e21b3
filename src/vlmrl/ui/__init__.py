"""`vlmrl ui`, the reward calculator and eval browser: `app` (the Starlette app, its routes and
`cli_ui`), `requests` (the calculator's request models), `example` (the worked example the
calculator opens with), `browser` (the eval browser's data) and `errors` (the `ApiError` every
module raises for the page)."""
