//! A tiny table type rendered as aligned text, Markdown or HTML, and number formatting.

/// Formats a number with about four significant digits, without exponent for ordinary sizes.
pub fn fmt_num(v: f64) -> String {
    if !v.is_finite() {
        return if v.is_nan() {
            "NaN".into()
        } else if v > 0.0 {
            "inf".into()
        } else {
            "-inf".into()
        };
    }
    let a = v.abs();
    if a == 0.0 {
        "0".into()
    } else if a >= 1000.0 {
        format!("{v:.0}")
    } else if a >= 100.0 {
        format!("{v:.1}")
    } else if a >= 1.0 {
        format!("{v:.2}")
    } else if a >= 1e-3 {
        format!("{v:.4}")
    } else {
        format!("{v:.2e}")
    }
}

/// Escapes text for XML and HTML (content and attribute values).
pub fn xml_escape(s: &str) -> String {
    let mut o = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '&' => o.push_str("&amp;"),
            '<' => o.push_str("&lt;"),
            '>' => o.push_str("&gt;"),
            '"' => o.push_str("&quot;"),
            '\'' => o.push_str("&apos;"),
            // Control characters other than tab/newline are not allowed in XML 1.0.
            c if (c as u32) < 0x20 && c != '\n' && c != '\t' && c != '\r' => o.push(' '),
            c => o.push(c),
        }
    }
    o
}

/// Rows of cells under a header. Cells that look numeric are right-aligned in text output.
#[derive(Debug, Clone, Default)]
pub struct Table {
    header: Vec<String>,
    rows: Vec<Vec<String>>,
}

fn numeric(s: &str) -> bool {
    let t = s.trim_start_matches(['+', '-']);
    t.chars().next().is_some_and(|c| c.is_ascii_digit()) || s == "-"
}

impl Table {
    /// A table with these column names.
    pub fn new(header: &[&str]) -> Self {
        Table {
            header: header.iter().map(|s| s.to_string()).collect(),
            rows: Vec::new(),
        }
    }

    /// Appends a row (short rows are padded, long rows truncated).
    pub fn row(&mut self, mut cells: Vec<String>) {
        cells.resize(self.header.len(), String::new());
        self.rows.push(cells);
    }

    /// Whether there are no rows.
    pub fn is_empty(&self) -> bool {
        self.rows.is_empty()
    }

    /// Aligned plain text: two spaces between columns, numbers right-aligned, a rule under the
    /// header. The last column is not padded.
    pub fn to_text(&self) -> String {
        let n = self.header.len();
        let mut w: Vec<usize> = self.header.iter().map(|h| h.chars().count()).collect();
        for r in &self.rows {
            for (i, c) in r.iter().enumerate() {
                w[i] = w[i].max(c.chars().count());
            }
        }
        let line = |cells: &[String], header: bool| {
            let mut s = String::new();
            for (i, c) in cells.iter().enumerate() {
                let pad = w[i].saturating_sub(c.chars().count());
                // The last column is free text (a reason), always left-aligned.
                let right = !header && i > 0 && i + 1 < n && numeric(c);
                if i > 0 {
                    s.push_str("  ");
                }
                if right {
                    s.push_str(&" ".repeat(pad));
                    s.push_str(c);
                } else {
                    s.push_str(c);
                    if i + 1 < n {
                        s.push_str(&" ".repeat(pad));
                    }
                }
            }
            s.trim_end().to_string() + "\n"
        };
        let mut out = line(&self.header, true);
        let total: usize = w.iter().sum::<usize>() + 2 * n.saturating_sub(1);
        out.push_str(&"-".repeat(total.min(120)));
        out.push('\n');
        for r in &self.rows {
            out.push_str(&line(r, false));
        }
        out
    }

    /// A GitHub-flavoured Markdown table (pipes in cells escaped).
    pub fn to_markdown(&self) -> String {
        let esc = |s: &str| s.replace('|', "\\|").replace('\n', " ");
        let mut out = format!(
            "| {} |\n|{}\n",
            self.header
                .iter()
                .map(|h| esc(h))
                .collect::<Vec<_>>()
                .join(" | "),
            self.header
                .iter()
                .enumerate()
                .map(|(i, _)| if i == 0 { "---|" } else { "---:|" })
                .collect::<String>()
        );
        for r in &self.rows {
            out.push_str(&format!(
                "| {} |\n",
                r.iter().map(|c| esc(c)).collect::<Vec<_>>().join(" | ")
            ));
        }
        out
    }

    /// An HTML `<table>`; `class_of(row, col)` may give a CSS class to a cell.
    pub fn to_html(&self, class_of: &dyn Fn(usize, usize) -> Option<&'static str>) -> String {
        let mut out = String::from("<table>\n<thead><tr>");
        for h in &self.header {
            out.push_str(&format!("<th>{}</th>", xml_escape(h)));
        }
        out.push_str("</tr></thead>\n<tbody>\n");
        for (ri, r) in self.rows.iter().enumerate() {
            out.push_str("<tr>");
            for (ci, c) in r.iter().enumerate() {
                let mut classes = Vec::new();
                if ci > 0 && numeric(c) {
                    classes.push("num");
                }
                if let Some(k) = class_of(ri, ci) {
                    classes.push(k);
                }
                if classes.is_empty() {
                    out.push_str(&format!("<td>{}</td>", xml_escape(c)));
                } else {
                    out.push_str(&format!(
                        "<td class=\"{}\">{}</td>",
                        classes.join(" "),
                        xml_escape(c)
                    ));
                }
            }
            out.push_str("</tr>\n");
        }
        out.push_str("</tbody>\n</table>\n");
        out
    }
}
