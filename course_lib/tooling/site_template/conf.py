"""Sphinx's configuration for the published edition (`make site`, course_lib/tooling/site.py).

course_lib.tooling.site writes the pages' sources (the executed notebooks made ready to publish, the
README as the index, the docs, the library files) into build/site-src/ and runs Sphinx with this
folder as its configuration directory. Nothing here executes a notebook or fetches anything: the
theme's icons are local files, formulas are MathML already, and no widget manager is loaded.
"""

__all__: list[str] = []  # Sphinx reads every name below; none is for import

project = "amp-course"  # site.py passes the course's repository as `project`
author = "the amp-course authors"
copyright = "the amp-course authors"  # noqa: A001 (Sphinx's name)

extensions = ["myst_nb", "sphinx_copybutton"]
root_doc = "index"
exclude_patterns = ["_doctrees", "**/*.py"]
templates_path = ["_templates"]
html_static_path = ["_static"]
html_css_files = ["amp.css"]

# MyST and myst-nb: the notebooks are published as executed, never executed here. Formulas arrive as
# MathML (site.mathml), so no $...$ parsing; headings get the anchors GitHub gives them.
nb_execution_mode = "off"
nb_ipywidgets_js = {}  # no widget manager from a CDN: widgets show their static picture
nb_output_stderr = "show"
nb_merge_streams = True
myst_heading_anchors = 3
myst_enable_extensions = []
suppress_warnings = ["myst.header", "mystnb.unknown_mime_type", "misc.highlighting_failure"]

# the theme: the whole book in the left sidebar, the page's contents on the right, search as you type,
# light and dark, previous/next above and below each page
html_theme = "pydata_sphinx_theme"
html_title = "amp-course"
html_copy_source = False  # the downloads are the course's own notebooks, not these sources
html_show_sourcelink = False
html_last_updated_fmt = None
html_context = {"default_mode": "auto"}  # light or dark as the reader's system says, until they choose
html_sidebars = {"**": ["amp-book-nav.html"], "index": ["amp-book-nav.html"], "search": ["amp-book-nav.html"]}
html_theme_options = {
    "navbar_start": ["navbar-logo"],
    "navbar_center": [],
    "navbar_end": ["theme-switcher"],
    "navbar_persistent": ["search-button-field"],
    "article_header_start": ["breadcrumbs"],
    "article_header_end": ["amp-prev-next-top.html"],
    "secondary_sidebar_items": ["page-toc"],
    "show_toc_level": 2,
    "show_prev_next": True,
    "search_as_you_type": True,
    "search_bar_text": "Search the course ...",
    "footer_start": ["amp-footer.html"],
    "footer_center": [],
    "footer_end": [],
    "back_to_top_button": True,
    "pygments_light_style": "a11y-high-contrast-light",
    "pygments_dark_style": "a11y-high-contrast-dark",
}

# copy buttons on code cells and code blocks, not on outputs; the prompt of a shell line is left out
copybutton_selector = "div.cell_input div.highlight pre, div.highlight-bash pre, div.highlight-python pre"
copybutton_prompt_text = "$ "
