"""Tools an agent calls: bash, str_replace_editor, browser, finish/submit."""
