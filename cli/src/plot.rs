//! Reserved and allocated memory over a trace, for each policy, as an SVG chart.

use plotters::prelude::*;

use crate::replay::{Outcome, Policy};

const GIB: f64 = (1u64 << 30) as f64;
/// At most this many points per line: each point is the maximum of its stretch of operations,
/// so no peak is lost.
const POINTS: usize = 2000;

fn colour(policy: Policy) -> RGBColor {
    match policy {
        Policy::Resmem => RGBColor(0x1f, 0x77, 0xb4),
        Policy::ResmemClassic => RGBColor(0x94, 0x67, 0xbd),
        Policy::ResmemVmm => RGBColor(0x2c, 0xa0, 0x2c),
        Policy::ResmemFront => RGBColor(0xff, 0x7f, 0x0e),
        Policy::Torch => RGBColor(0xd6, 0x27, 0x28),
    }
}

/// Down-sample a series to at most [`POINTS`] points, keeping each stretch's maximum.
fn thin(values: impl ExactSizeIterator<Item = u64>) -> Vec<(u64, f64)> {
    let n = values.len();
    let stride = n.div_ceil(POINTS).max(1);
    let mut out = Vec::with_capacity(n / stride + 1);
    let mut best = 0;
    for (i, v) in values.enumerate() {
        best = best.max(v);
        if (i + 1) % stride == 0 || i + 1 == n {
            out.push((i as u64, best as f64 / GIB));
            best = 0;
        }
    }
    out
}

/// The chart as SVG text.
pub fn svg(title: &str, outcomes: &[Outcome]) -> Result<String, String> {
    let mut text = String::new();
    {
        let root = SVGBackend::with_string(&mut text, (1100, 600)).into_drawing_area();
        draw(&root, title, outcomes).map_err(|e| format!("drawing the plot failed: {e}"))?;
        root.present()
            .map_err(|e| format!("drawing the plot failed: {e}"))?;
    }
    Ok(text)
}

fn draw<DB: DrawingBackend>(
    root: &DrawingArea<DB, plotters::coord::Shift>,
    title: &str,
    outcomes: &[Outcome],
) -> Result<(), DrawingAreaErrorKind<DB::ErrorType>> {
    root.fill(&WHITE)?;
    let ops = outcomes
        .iter()
        .map(|o| o.timeline.len())
        .max()
        .unwrap_or(0)
        .max(1) as u64;
    let top = outcomes
        .iter()
        .flat_map(|o| o.timeline.iter().map(|&(a, r)| a.max(r)))
        .max()
        .unwrap_or(0) as f64
        / GIB;
    let mut chart = ChartBuilder::on(root)
        .caption(title, ("sans-serif", 22))
        .margin(18)
        .x_label_area_size(45)
        .y_label_area_size(70)
        .build_cartesian_2d(0..ops, 0.0..(top * 1.08).max(0.001))?;
    chart
        .configure_mesh()
        .x_desc("operation")
        .y_desc("GiB")
        .light_line_style(RGBColor(0xee, 0xee, 0xee))
        .draw()?;
    for o in outcomes {
        let c = colour(o.policy);
        let reserved = thin(o.timeline.iter().map(|&(_, r)| r));
        let allocated = thin(o.timeline.iter().map(|&(a, _)| a));
        chart
            .draw_series(LineSeries::new(reserved, c.stroke_width(2)))?
            .label(format!("{} reserved", o.policy.name()))
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 24, y)], c.stroke_width(2)));
        let faint = c.mix(0.45);
        chart
            .draw_series(LineSeries::new(allocated, faint.stroke_width(1)))?
            .label(format!("{} allocated", o.policy.name()))
            .legend(move |(x, y)| {
                PathElement::new(vec![(x, y), (x + 24, y)], faint.stroke_width(1))
            });
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperLeft)
        .background_style(WHITE.mix(0.85))
        .border_style(RGBColor(0x99, 0x99, 0x99))
        .draw()?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn thinning_keeps_the_peaks() {
        let values: Vec<u64> = (0..10_000u64)
            .map(|i| if i == 4321 { 7 << 30 } else { 1 << 30 })
            .collect();
        let points = thin(values.into_iter());
        assert_eq!(points.len(), 2000);
        assert_eq!(points.iter().filter(|p| p.1 == 7.0).count(), 1);
        assert_eq!(points.last().unwrap().0, 9999);
    }
}
