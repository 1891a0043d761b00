"""What the user sees: text, static HTML, figures and the live panel, all from one view of the report."""
