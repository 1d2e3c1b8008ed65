//! Line plots as PNG files, for the simulator figures and any bench that wants a picture.
//!
//! Drawn with `plotters` into an in-memory RGB buffer and encoded with `png`, so no system
//! graphics library is needed. Text needs a TrueType font read at run time: `$LANBUS_FONT` if set,
//! else DejaVu Sans (`fonts-dejavu-core`, installed by `scripts/setup`). Without a font the plot
//! still has its frame, grid and lines, only no text, and [`write_png`] says so on stderr.

use std::path::Path;
use std::sync::OnceLock;

use anyhow::Context;
use plotters::coord::Shift;
use plotters::prelude::*;

/// One line of a plot.
#[derive(Debug, Clone)]
pub struct Series {
    /// Legend text.
    pub name: String,
    /// Points in x order.
    pub points: Vec<(f64, f64)>,
}

/// A plot with one or more lines.
#[derive(Debug, Clone)]
pub struct Plot {
    /// Caption above the plot.
    pub title: String,
    /// X axis label.
    pub x_label: String,
    /// Y axis label.
    pub y_label: String,
    /// Logarithmic x axis (all x must be positive).
    pub x_log: bool,
    /// Logarithmic y axis (all y must be positive).
    pub y_log: bool,
    /// Put the legend in the upper right corner (else upper left), away from the data.
    pub legend_right: bool,
    /// The lines.
    pub series: Vec<Series>,
}

/// A published result drawn beside the measured lines: black, dashed, with a cross at each point.
#[derive(Debug, Clone)]
pub struct Reference {
    /// Legend text (say whose result it is and where it is stated).
    pub name: String,
    /// Points in the order they are joined.
    pub points: Vec<(f64, f64)>,
}

const WIDTH: u32 = 900;
const HEIGHT: u32 = 600;
const FONT_PATHS: [&str; 2] =
    ["/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf", "/usr/share/fonts/dejavu/DejaVuSans.ttf"];

/// Registers a TrueType font with plotters once per process; false when none could be loaded.
fn font_available() -> bool {
    static LOADED: OnceLock<bool> = OnceLock::new();
    *LOADED.get_or_init(|| {
        let candidates: Vec<String> = std::env::var("LANBUS_FONT")
            .ok()
            .into_iter()
            .chain(FONT_PATHS.iter().map(|s| s.to_string()))
            .collect();
        for path in candidates {
            if let Ok(bytes) = std::fs::read(&path) {
                // plotters keeps fonts for the life of the process; leaking the one copy is that.
                let bytes: &'static [u8] = Box::leak(bytes.into_boxed_slice());
                if plotters::style::register_font("sans-serif", FontStyle::Normal, bytes).is_ok() {
                    return true;
                }
            }
        }
        false
    })
}

/// Writes `plot` to `path` as a PNG of 900 × 600 pixels.
pub fn write_png(plot: &Plot, path: &Path) -> anyhow::Result<()> {
    write_png_with(plot, &[], path)
}

/// Writes `plot` with `references` drawn over its lines to `path` as a PNG of 900 × 600 pixels.
pub fn write_png_with(plot: &Plot, references: &[Reference], path: &Path) -> anyhow::Result<()> {
    let with_text = font_available();
    if !with_text {
        eprintln!(
            "lanbus: no TrueType font found (set LANBUS_FONT or install fonts-dejavu-core); {} has no text",
            path.display()
        );
    }
    let mut rgb = vec![255u8; (WIDTH * HEIGHT * 3) as usize];
    {
        let root = BitMapBackend::with_buffer(&mut rgb, (WIDTH, HEIGHT)).into_drawing_area();
        draw(plot, references, &root, with_text)
            .map_err(|e| anyhow::anyhow!("drawing {}: {e}", path.display()))?;
        root.present().map_err(|e| anyhow::anyhow!("drawing {}: {e}", path.display()))?;
    }
    let file = std::fs::File::create(path).with_context(|| format!("creating {}", path.display()))?;
    let mut encoder = png::Encoder::new(std::io::BufWriter::new(file), WIDTH, HEIGHT);
    encoder.set_color(png::ColorType::Rgb);
    encoder.set_depth(png::BitDepth::Eight);
    let mut writer = encoder.write_header().with_context(|| format!("writing {}", path.display()))?;
    writer.write_image_data(&rgb).with_context(|| format!("writing {}", path.display()))?;
    writer.finish().with_context(|| format!("writing {}", path.display()))?;
    Ok(())
}

fn bounds(values: impl Iterator<Item = f64>, log: bool) -> (f64, f64) {
    let (mut lo, mut hi) = (f64::INFINITY, f64::NEG_INFINITY);
    for v in values.filter(|v| v.is_finite() && (!log || *v > 0.0)) {
        lo = lo.min(v);
        hi = hi.max(v);
    }
    if !lo.is_finite() {
        return if log { (1.0, 10.0) } else { (0.0, 1.0) };
    }
    if log {
        (lo / 1.5, hi * 1.5)
    } else {
        let lo = if lo > 0.0 { 0.0 } else { lo };
        let span = (hi - lo).max(1e-9);
        (lo, hi + span * 0.08)
    }
}

/// A short tick label: scientific for very small or large values, else at most three decimals.
fn tick(v: f64) -> String {
    let a = v.abs();
    if a == 0.0 {
        return "0".into();
    }
    if !(1e-3..1e5).contains(&a) {
        let s = format!("{v:.1e}");
        return s.replace(".0e", "e");
    }
    let s = format!("{v:.3}");
    s.trim_end_matches('0').trim_end_matches('.').to_string()
}

type DrawResult<T> = Result<T, Box<dyn std::error::Error>>;

fn draw<DB: DrawingBackend>(
    plot: &Plot,
    references: &[Reference],
    root: &DrawingArea<DB, Shift>,
    with_text: bool,
) -> DrawResult<()>
where
    DB::ErrorType: 'static,
{
    root.fill(&WHITE)?;
    let all = || plot.series.iter().map(|s| &s.points).chain(references.iter().map(|r| &r.points));
    let xs = bounds(all().flat_map(|p| p.iter().map(|p| p.0)), plot.x_log);
    let ys = bounds(all().flat_map(|p| p.iter().map(|p| p.1)), plot.y_log);
    let r = references;
    // One generic body per axis kind: plotters types linear and log ranges differently.
    match (plot.x_log, plot.y_log) {
        (false, false) => body(plot, r, root, with_text, xs.0..xs.1, ys.0..ys.1),
        (true, false) => body(plot, r, root, with_text, (xs.0..xs.1).log_scale(), ys.0..ys.1),
        (false, true) => body(plot, r, root, with_text, xs.0..xs.1, (ys.0..ys.1).log_scale()),
        (true, true) => body(plot, r, root, with_text, (xs.0..xs.1).log_scale(), (ys.0..ys.1).log_scale()),
    }
}

const COLORS: [RGBColor; 6] = [
    RGBColor(31, 119, 180),
    RGBColor(214, 39, 40),
    RGBColor(44, 160, 44),
    RGBColor(148, 103, 189),
    RGBColor(255, 127, 14),
    RGBColor(90, 90, 90),
];

fn body<DB, X, Y>(
    plot: &Plot,
    references: &[Reference],
    root: &DrawingArea<DB, Shift>,
    with_text: bool,
    x: X,
    y: Y,
) -> DrawResult<()>
where
    DB: DrawingBackend,
    DB::ErrorType: 'static,
    X: plotters::coord::ranged1d::AsRangedCoord<Value = f64>,
    Y: plotters::coord::ranged1d::AsRangedCoord<Value = f64>,
    X::CoordDescType: plotters::coord::ranged1d::ValueFormatter<f64>,
    Y::CoordDescType: plotters::coord::ranged1d::ValueFormatter<f64>,
{
    let mut builder = ChartBuilder::on(root);
    builder.margin(20);
    if with_text {
        builder.caption(&plot.title, ("sans-serif", 24)).x_label_area_size(50).y_label_area_size(70);
    } else {
        builder.x_label_area_size(0).y_label_area_size(0);
    }
    let mut chart = builder.build_cartesian_2d(x, y)?;
    let mut mesh = chart.configure_mesh();
    mesh.light_line_style(RGBColor(235, 235, 235));
    if with_text {
        mesh.x_label_formatter(&|v| tick(*v))
            .y_label_formatter(&|v| tick(*v))
            .x_desc(plot.x_label.as_str())
            .y_desc(plot.y_label.as_str())
            .label_style(("sans-serif", 15))
            .axis_desc_style(("sans-serif", 17));
    } else {
        mesh.x_labels(0).y_labels(0);
    }
    mesh.draw()?;
    // The points an axis can show: finite, and positive on a logarithmic one.
    let drawable = |points: &[(f64, f64)]| -> Vec<(f64, f64)> {
        points
            .iter()
            .copied()
            .filter(|p| p.0.is_finite() && p.1.is_finite())
            .filter(|p| (!plot.x_log || p.0 > 0.0) && (!plot.y_log || p.1 > 0.0))
            .collect()
    };
    for (i, s) in plot.series.iter().enumerate() {
        let color = COLORS[i % COLORS.len()];
        let points = drawable(&s.points);
        let line = chart.draw_series(LineSeries::new(points.clone(), color.stroke_width(2)))?;
        if with_text {
            line.label(s.name.as_str())
                .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], color.stroke_width(2)));
        }
        chart.draw_series(points.into_iter().map(|p| Circle::new(p, 3, color.filled())))?;
    }
    for r in references {
        let points = drawable(&r.points);
        let line = chart.draw_series(DashedLineSeries::new(points.clone(), 8, 5, BLACK.stroke_width(2)))?;
        if with_text {
            line.label(r.name.as_str()).legend(|(x, y)| {
                EmptyElement::at((x, y))
                    + PathElement::new(vec![(0, 0), (8, 0)], BLACK.stroke_width(2))
                    + PathElement::new(vec![(12, 0), (20, 0)], BLACK.stroke_width(2))
            });
        }
        chart.draw_series(points.into_iter().map(|p| Cross::new(p, 5, BLACK.stroke_width(2))))?;
    }
    if with_text {
        chart
            .configure_series_labels()
            .background_style(WHITE.mix(0.85))
            .border_style(BLACK)
            .label_font(("sans-serif", 15))
            .position(if plot.legend_right {
                SeriesLabelPosition::UpperRight
            } else {
                SeriesLabelPosition::UpperLeft
            })
            .draw()?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ticks_are_short() {
        assert_eq!(tick(1e-5 * 0.9999999999), "1e-5");
        assert_eq!(tick(0.001), "0.001");
        assert_eq!(tick(2.5), "2.5");
        assert_eq!(tick(1000.0), "1000");
        assert_eq!(tick(0.0), "0");
        assert_eq!(tick(2.5e-7), "2.5e-7");
    }

    #[test]
    fn draws_lines_without_a_font() {
        let mut rgb = vec![255u8; (WIDTH * HEIGHT * 3) as usize];
        let plot = Plot {
            title: "t".into(),
            x_label: "x".into(),
            y_label: "y".into(),
            x_log: false,
            y_log: true,
            legend_right: true,
            series: vec![Series { name: "a".into(), points: vec![(0.0, 1.0), (1.0, 100.0)] }],
        };
        {
            let root = BitMapBackend::with_buffer(&mut rgb, (WIDTH, HEIGHT)).into_drawing_area();
            draw(&plot, &[], &root, false).unwrap();
            root.present().unwrap();
        }
        // The line's colour appears.
        let blue = rgb.chunks(3).filter(|p| *p == [31, 119, 180]).count();
        assert!(blue > 500, "{blue} pixels of the line");
    }

    #[test]
    fn draws_references_in_black_over_the_lines() {
        let plot = Plot {
            title: "t".into(),
            x_label: "x".into(),
            y_label: "y".into(),
            x_log: false,
            y_log: false,
            legend_right: true,
            series: vec![Series { name: "a".into(), points: vec![(0.0, 0.0), (1.0, 1.0)] }],
        };
        let black = |references: &[Reference]| {
            let mut rgb = vec![255u8; (WIDTH * HEIGHT * 3) as usize];
            {
                let root = BitMapBackend::with_buffer(&mut rgb, (WIDTH, HEIGHT)).into_drawing_area();
                draw(&plot, references, &root, false).unwrap();
                root.present().unwrap();
            }
            rgb.chunks(3).filter(|p| *p == [0, 0, 0]).count()
        };
        let paper = Reference { name: "paper".into(), points: vec![(0.0, 0.9), (0.2, 0.9), (0.2, 0.0)] };
        let (without, with) = (black(&[]), black(&[paper]));
        assert!(with > without + 300, "{without} black pixels without, {with} with the reference");
    }

    #[test]
    fn writes_a_png() {
        let dir = std::env::temp_dir().join(format!("lanbus-plot-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("t.png");
        let plot = Plot {
            title: "test".into(),
            x_label: "x".into(),
            y_label: "y".into(),
            x_log: true,
            y_log: false,
            legend_right: false,
            series: vec![Series { name: "a".into(), points: vec![(1e-6, 1.0), (1e-3, 3.0), (1e-2, 2.0)] }],
        };
        write_png(&plot, &path).unwrap();
        let bytes = std::fs::read(&path).unwrap();
        assert_eq!(&bytes[1..4], b"PNG");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
